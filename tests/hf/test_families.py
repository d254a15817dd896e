"""The family matrix's fast subset (the full one: experiments/hf_families.py -> docs/hf_families.md).

4 gloo ranks, a heterogeneous plan (degrees 4, 2, 1, an idle rank), fp64: StableLM (decoder layer
drops **kwargs: routed by hooks), GPT-NeoX (config.is_decoder=False, causal attention) and Qwen2-MoE
(router loss off, and on: against HF's own padded-batch loss) and DeepSeek-V3 (latent attention, v narrower
than q/k) train exactly against the native model; a hybrid whose linear attention has no registered token mixer
(MiniMax), an ALiBi model and DeepSeek-V3.2's sparse attention (a key indexer) are refused by name. One process: 3-D positions refused, routed context under gradient
checkpointing, and the registry the matrix reads."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf.family_runs import assert_exact, family_results  # noqa: E402

from flexsp.hf import UnsupportedModelError, prepare_model  # noqa: E402
from flexsp.hf.families import batch, causal_lm_types, native_step, tiny_model  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402

EXACT = ("stablelm", "gpt_neox", "qwen2_moe", "qwen2_moe+router-loss",
         "deepseek_v3")   # latent attention: v heads narrower than q/k, padded for the kernels
REFUSED = {"minimax": "1 of its 2 decoder layers ran FlexSP's attention",   # lightning attention: no mixer registered
           "bloom": "fails on a packed row",
           "deepseek_v32": "sparse attention with a key indexer"}


@pytest.fixture(scope="module")
def results():
    return family_results((*EXACT, *REFUSED), timeout=240)


@pytest.mark.parametrize("model_type", EXACT)
def test_family_trains_exactly(results, model_type):
    assert_exact(results, model_type)
    assert results[0]["stablelm"].wrapped and not results[0]["gpt_neox"].wrapped


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_family_is_refused_by_name(results, model_type):
    for res in results:
        assert res[model_type].status == "refused" and REFUSED[model_type] in res[model_type].detail


def test_registry_is_transformers_own():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    types = causal_lm_types()
    assert set(types) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) and {"llama", "stablelm", "gpt_neox"} <= set(types)


def test_native_reference_sees_a_changed_model():
    """The matrix's reference is not vacuous: another seed gives another loss and update."""
    a, b = native_step(tiny_model("llama"), batch()), native_step(tiny_model("llama", seed=1), batch())
    assert a[0] != pytest.approx(b[0], rel=1e-6) and not torch.allclose(a[1], b[1])


def test_3d_positions_are_refused():
    """Image/video 3-D (t, h, w) positions: refused; text positions are 1-D (tests/hf/test_composite.py)."""
    sp = prepare_model(tiny_model("llama"), max_seqlen=17)
    packed = pack(batch()[:2], 1)
    three_d = packed.position_ids[None].expand(3, -1)
    with pytest.raises(UnsupportedModelError, match="3-D rotary positions, mRoPE"):
        sp.shard_loss(packed.input_ids, three_d, packed.labels,
                      AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, backend="sdpa"))


def test_routed_context_survives_gradient_checkpointing():
    """StableLM's layer drops **kwargs; the hooks re-route the context when checkpointing re-runs the layer."""
    ref = tiny_model("stablelm")
    want_loss, want = native_step(copy.deepcopy(ref), batch())
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    sp = prepare_model(model, max_seqlen=17)
    assert sp.routed == ["StableLmDecoderLayer"] * 2
    packed = pack(batch(), 1)
    denominator = sum(len(s) - 1 for s in batch())
    loss = sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels,
                         AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen,
                                          backend="sdpa")) / denominator
    loss.backward()
    got = torch.cat([(p - 0.5 * p.grad).reshape(-1) for p in sp.parameters()]).detach()
    assert float(loss) == pytest.approx(want_loss, rel=1e-12)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12
    with torch.no_grad():   # and the plain model, no context: untouched by the hooks
        s = batch()[0]
        assert torch.equal(model(input_ids=s[None]).logits, ref(input_ids=s[None]).logits)
