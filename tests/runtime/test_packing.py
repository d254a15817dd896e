"""Packing: bounds, restarted positions, in-sequence labels, even shards, masked padding."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.runtime.shard import loss_tokens, pack
from flexsp.runtime.sp.context import IGNORE_INDEX, PAD_TOKEN


def _seqs(lengths, start=1):
    out, nxt = [], start
    for n in lengths:
        out.append(torch.arange(nxt, nxt + n))
        nxt += n
    return out


def test_bounds_positions_and_labels():
    p = pack(_seqs([3, 1, 2]), degree=4)
    assert p.cu_seqlens == (0, 3, 4, 6)
    assert p.padded_tokens == 8 and p.shard_tokens == 2 and p.max_seqlen == 3
    assert p.input_ids.tolist() == [1, 2, 3, 4, 5, 6, PAD_TOKEN, PAD_TOKEN]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1, 0, 0]
    I = IGNORE_INDEX
    assert p.labels.tolist() == [2, 3, I, I, 6, I, I, I]   # never across a boundary, never on padding
    assert int((p.labels != I).sum()) == loss_tokens([3, 1, 2]) == 3


@pytest.mark.parametrize("lengths,degree", [([5], 1), ([5, 7], 2), ([1, 1, 1], 4), ([9, 2, 4], 8), ([2], 8)])
def test_shards_cover_every_token_exactly_once(lengths, degree):
    seqs = _seqs(lengths)
    p = pack(seqs, degree)
    shards = [p.shard(r) for r in range(degree)]
    assert {s.input_ids.numel() for s in shards} == {p.shard_tokens}
    assert p.padded_tokens % degree == 0 and p.padded_tokens - sum(lengths) < degree
    real = torch.cat([s.input_ids[: s.real_tokens] for s in shards])
    assert real.tolist() == torch.cat(seqs).tolist()
    for s in shards:   # everything past real_tokens is padding with no label
        assert (s.input_ids[s.real_tokens:] == PAD_TOKEN).all() and (s.labels[s.real_tokens:] == IGNORE_INDEX).all()
    assert sum(s.real_tokens for s in shards) == sum(lengths)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="degree must be >= 1, got 0"):
        pack(_seqs([2]), 0)
    with pytest.raises(ValueError, match="at least one sequence"):
        pack([], 2)
    with pytest.raises(ValueError, match=r"local rank 2 is outside 0..1"):
        pack(_seqs([2]), 2).shard(2)
