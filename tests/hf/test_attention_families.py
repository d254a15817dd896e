"""Sliding windows, sinks, softcaps, chunked attention and logit scaling in the HF families that use them:
one SGD step on 4 gloo ranks under a heterogeneous plan (a Ulysses 2 x ring 2 group, degrees 4, 2 and 1),
fp64, every sequence longer than the window and the chunk, equal to the native model run sequence by
sequence (``flexsp.hf.families.check_family``). MoE families run with their router aux loss off."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.distributed import run_distributed  # noqa: E402

from flexsp.hf.families import LENGTHS, RTOL  # noqa: E402
from flexsp.plan.types import Group, MicroBatch, Plan  # noqa: E402

WINDOW = CHUNK = 4
assert sorted(LENGTHS)[1] > WINDOW   # all but the shortest sequence are longer than the window and the chunk
MOE = {"output_router_logits": False}
FAMILIES = {
    "gemma2": {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
    "gemma3_text": {"sliding_window": WINDOW},
    "gpt_oss": {"sliding_window": WINDOW, **MOE},
    "granitemoe_swa": {"sliding_window": WINDOW, **MOE},
    "mistral": {"sliding_window": WINDOW},
    # the NoPE layer's temperature tuning crosses its floor inside every sequence but the shortest
    "llama4_text": {"attention_chunk_size": CHUNK, "layer_types": ["chunked_attention", "full_attention"],
                    "no_rope_layers": [1, 0], "attn_temperature_tuning": True, "floor_scale": 3, "attn_scale": 0.5,
                    **MOE},
    "granite": {"logits_scaling": 4.0},
}


def ring_plan() -> Plan:
    mb = lambda *gs: MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s), ring=ring)  # noqa: E731
                                      for r, s, ring in gs))
    return Plan(num_gpus=4, predicted_time=0.0, micro_batches=(
        mb(((0, 1, 2, 3), (1, 3), 2)),                                       # Ulysses 2 x ring 2
        mb(((0, 1), (0, 4), 1), ((2,), (5,), 1), ((3,), (2, 6), 1)),          # degrees 2, 1, 1
        mb(((0, 1, 2, 3), (7,), 1))))                                         # Ulysses 4


def _worker(rank, world):
    import warnings

    from flexsp.hf.families import check_family
    from flexsp.runtime import GroupPool
    warnings.simplefilter("ignore")
    pool = GroupPool(splits=[(2, 2)])   # the ring group's Ulysses x ring split
    return {t: check_family(t, pool, ring_plan(), kw) for t, kw in FAMILIES.items()}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=600)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_attention_family_trains_exactly(results, model_type):
    for res in results:
        r = res[model_type]
        assert r.status == "exact", r
        assert r.loss_rel <= RTOL and r.update_rel <= RTOL
