"""One process: the adapter at SP degree 1 against the unmodified HF model, the registry wrapper's
pass-through, the refused features, the chunked loss and the no-[S, S]-mask guarantee."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
import torch.nn.functional as F  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from flexsp.errors import FlexSPError  # noqa: E402
from flexsp.hf import (
    HFCausalLM,
    UnsupportedModelError,
    install,
    is_installed,
    linear_cross_entropy,
    load_config,
    prepare_model,
    uninstall,
)
from flexsp.hf.features import FEATURES_ATTR, attention_modules, layer_features  # noqa: E402
from flexsp.runtime import AttentionContext, ShardingError, pack  # noqa: E402
from flexsp.runtime.kernels import Features  # noqa: E402
from flexsp.runtime.models.protocol import SPModel  # noqa: E402

from .models import ARCHS, LENGTHS, SMALL, batch, build, config, reference  # noqa: E402


def _ctx(packed, **kw):
    return AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, backend="sdpa", **kw)


@pytest.mark.parametrize("arch", ARCHS)
def test_degree_one_equals_unmodified_hf(arch):
    ref = build(arch)
    want_loss, want_grads = reference(ref, batch(0))
    sp = prepare_model(copy.deepcopy(ref), max_seqlen=max(LENGTHS), chunk_tokens=7)
    assert isinstance(sp, SPModel) and isinstance(sp, HFCausalLM)
    packed = pack(batch(0), 1)
    loss = sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed)) / sum(n - 1 for n in LENGTHS)
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in sp.parameters()])
    assert float(loss) == pytest.approx(want_loss, rel=1e-12)
    assert float((grads - want_grads).abs().max() / want_grads.abs().max()) < 1e-7
    # Logits of the shard, as the pre-shard_loss executor asks for them.
    logits = sp(packed.input_ids, packed.position_ids, _ctx(packed))
    with torch.no_grad():
        want_logits = ref(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None],
                          use_cache=False).logits[0]
    torch.testing.assert_close(logits, want_logits, rtol=1e-7, atol=1e-9)


def test_reference_is_per_sequence():
    """The reference (HF's own packed-position masking) equals running each sequence alone."""
    model = build("qwen2")
    packed_loss, _ = reference(model, batch(0))
    with torch.no_grad():
        alone = sum(F.cross_entropy(model(input_ids=s[None], use_cache=False).logits[0, :-1], s[1:], reduction="sum")
                    for s in batch(0)) / sum(n - 1 for n in LENGTHS)
    assert packed_loss == pytest.approx(float(alone), rel=1e-12)


@pytest.mark.parametrize("key", ["sdpa", "eager"])
def test_wrapper_passes_other_calls_through(key):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config("gemma"), attn_implementation=key).double()
    packed = pack(batch(1)[:3], 1)
    args = dict(input_ids=packed.input_ids[None], position_ids=packed.position_ids[None], use_cache=False)
    was = is_installed(key)
    uninstall(key)
    try:
        plain = model(**args).logits
        install(key)
        install(key)   # idempotent
        assert is_installed(key)
        assert torch.equal(model(**args).logits, plain)   # no context in the kwargs: the original function
    finally:
        if not was:
            uninstall(key)
    assert is_installed(key) == was


def test_no_square_mask_is_built(monkeypatch):
    """The adapter hands transformers a prepared empty mask: its mask builders never run."""
    sp = prepare_model(build("qwen3"), max_seqlen=max(LENGTHS))

    def refuse(*a, **k):
        raise AssertionError("a [tokens, tokens] mask was built")

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping, "sdpa", refuse)
    packed = pack(batch(0), 1)
    sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed)).backward()


def test_loss_never_holds_the_whole_shards_logits():
    sp = prepare_model(build("llama"), max_seqlen=10, chunk_tokens=8)
    gen = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(1, SMALL["vocab_size"], (10,), generator=gen) for _ in range(30)], 1)
    tokens, vocab = packed.padded_tokens, SMALL["vocab_size"]
    saved = []
    params = {p.data_ptr() for p in sp.parameters()}

    def keep(t):
        # the CPU attention kernel's [.., tokens, tokens] block-diagonal mask is attention's cost, not the loss's
        if t.data_ptr() not in params and tuple(t.shape[-2:]) != (tokens, tokens):
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed))
    loss.backward()
    assert tokens * vocab > 2 * max(saved)   # nothing kept for backward comes near [tokens, vocab]
    assert max(saved) >= tokens * SMALL["hidden_size"]   # (the hook did see the decoder's activations)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_linear_cross_entropy_matches_autograd(dtype, tol, chunk):
    gen = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(23, 16, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(37, 16, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(37, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, (23,), generator=gen)
    labels[::4] = -100
    got = linear_cross_entropy(hidden, weight, bias, labels, chunk)
    (got * 0.5).backward()
    mine = [t.grad for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    acc = torch.promote_types(dtype, torch.float32)
    want = F.cross_entropy(F.linear(hidden, weight, bias).to(acc), labels, reduction="sum")
    (want * 0.5).backward()
    assert got.dtype == acc
    assert float(got) == pytest.approx(float(want), rel=tol)
    for a, t in zip(mine, (hidden, weight, bias)):
        assert a.dtype == t.dtype
        assert float((a.float() - t.grad.float()).abs().max()) <= tol * max(1.0, float(t.grad.float().abs().max()))


@pytest.mark.parametrize("arch", ARCHS)
def test_protocol_shapes(arch):
    sp = prepare_model(build(arch), max_seqlen=max(LENGTHS))
    cfg = config(arch)
    assert sp.sp_heads() == (cfg.num_attention_heads, cfg.num_key_value_heads)
    units = sp.fsdp_units()
    assert len(units) == cfg.num_hidden_layers and all(u in list(sp.model.modules()) for u in units)


def test_heads_the_degree_cannot_split():
    sp = prepare_model(build("llama"), max_seqlen=max(LENGTHS))
    packed = pack(batch(0), 8)

    class FakeGroup:   # degree 8 > 4 heads is refused before any communication
        pass

    ctx = _ctx(packed)
    object.__setattr__(ctx, "group", FakeGroup())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.distributed, "get_world_size", lambda group=None: 8)
        with pytest.raises(ShardingError, match="degree 8 does not divide the 4 attention heads"):
            sp.shard_loss(*(t[:packed.shard_tokens] for t in (packed.input_ids, packed.position_ids, packed.labels)),
                          ctx)


def _tiny(arch, **kw):
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**SMALL, "num_attention_heads": 4,
                                                                          "num_key_value_heads": 2, **kw}))


@pytest.mark.parametrize("arch,kw,pattern", [
    ("llama", {"attention_dropout": 0.1}, r"LlamaForCausalLM .*attention dropout > 0"),
    ("llama", {"is_causal": False}, r"LlamaForCausalLM .*non-causal attention"),
])
def test_unsupported_features_are_named(arch, kw, pattern):
    with pytest.raises(UnsupportedModelError, match=pattern) as info:
        prepare_model(_tiny(arch, **kw), max_seqlen=17)
    assert isinstance(info.value, FlexSPError)


LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 4,
            "long_factor": [4.0 + i for i in range(4)], "original_max_position_embeddings": 12}


@pytest.mark.parametrize("kw,limit", [(dict(rope_parameters=LONGROPE, original_max_position_embeddings=12, pad_token_id=0), 12),
                                      (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                             "factor": 2.0}, max_position_embeddings=12), 12)],
                         ids=["longrope", "dynamic"])
def test_a_rope_that_switches_by_the_calls_longest_position_is_refused_past_its_switch(kw, limit):
    """transformers' longrope and dynamic RoPE pick their frequencies from the longest position of the call:
    packed and sharded over ranks, one sequence's tokens would rotate by different frequencies (a review measured
    1e-2 logit error at degree 2 past the switch). Up to the switch every call rotates as the model does."""
    model = _tiny("phi3", **kw) if "original_max_position_embeddings" in kw else _tiny("llama", **kw)
    prepare_model(copy.deepcopy(model), max_seqlen=limit)
    with pytest.raises(UnsupportedModelError, match=f"rope_type .* past {limit} tokens .* the longest here is 40"):
        prepare_model(model, max_seqlen=40)


@pytest.mark.parametrize("arch,kw,want", [
    ("mistral", {"sliding_window": 5}, {0: Features(window=5), 1: Features(window=5)}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0},
     {0: Features(window=6), 1: Features(window=6)}),
    ("qwen2", {"sliding_window": 6}, {0: Features(), 1: Features()}),          # use_sliding_window False
    # Qwen2-MoE derives its layer types the other way round (max_window_layers=0: every layer full): the types
    # decide, not the window (it was put on every layer: a silently different attention past 6 tokens)
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0,
                   "output_router_logits": False}, {0: Features(), 1: Features()}),
    ("gemma2", {"head_dim": 8, "sliding_window": 5}, {0: Features(window=5, softcap=50.0), 1: Features(softcap=50.0)}),
    # Gemma 3 keeps attn_logit_softcapping in its config but its attention never applies it: neither does FlexSP
    ("gemma3_text", {"head_dim": 8, "sliding_window": 5, "attn_logit_softcapping": 5.0,
                     "layer_types": ["sliding_attention", "full_attention"]},
     {0: Features(window=5), 1: Features()}),
    ("gpt_oss", {"num_local_experts": 2, "num_experts_per_tok": 1, "head_dim": 8, "sliding_window": 5},
     {0: Features(window=5), 1: Features()}),
    ("llama4_text", {"attention_chunk_size": 3, "layer_types": ["chunked_attention", "full_attention"]},
     {0: Features(chunk=3), 1: Features()}),
    # EXAONE 4 keeps the config's window on every attention module, global (NoPE) layers too, and applies it on
    # sliding layers only: a full_attention layer is never windowed (it was, and the family read as refused)
    ("exaone4", {"sliding_window": 5, "layer_types": ["sliding_attention", "full_attention"]},
     {0: Features(window=5), 1: Features()}),
])
def test_layer_features_are_read_once_per_layer_and_set_on_the_modules(arch, kw, want):
    model = _tiny(arch, **kw).double()
    assert layer_features(model) == want
    prepare_model(model, probe=False)
    assert {i: getattr(m, FEATURES_ATTR) for i, m in attention_modules(model).items()} == want


@pytest.mark.parametrize("arch,kw", [("mistral", {"sliding_window": 5}),
                                     ("gemma2", {"head_dim": 8, "sliding_window": 5, "attn_logit_softcapping": 1.0,
                                                 "final_logit_softcapping": 2.0}),
                                     ("cohere", {"logit_scale": 0.5})])
def test_windows_softcaps_and_logit_scales_are_computed_and_the_probe_sees_them_dropped(arch, kw, monkeypatch):
    """A window shorter than the sequences, softcaps and a logit scale are computed exactly (the probe compares
    with the native model); with the layer features or the logit transform dropped, the per-call check (what
    the layer asks for against what was read) or the probe refuses."""
    import flexsp.hf.adapter as adapter_module
    model = _tiny(arch, **kw).double()
    prepare_model(copy.deepcopy(model))                      # exact: the probe passes
    monkeypatch.setattr(adapter_module, "layer_features", lambda m: {i: Features() for i in range(2)})
    monkeypatch.setattr(adapter_module, "logit_transform", lambda m: (1.0, None))
    with pytest.raises(UnsupportedModelError, match="differ from the native model|asked for a (sliding window|score "
                                                    "softcap) its config does not give"):
        prepare_model(copy.deepcopy(model))


def test_a_call_asking_for_another_window_than_the_config_is_refused():
    model = _tiny("mistral", sliding_window=5).double()
    sp = prepare_model(model)
    for module in attention_modules(model).values():
        setattr(module, FEATURES_ATTR, Features(window=7))   # as if the config said 7 but the layer passes 5
    packed = pack(batch(0), 1)
    with pytest.raises(UnsupportedModelError, match=r"layer 0\) asked for a sliding window"):
        sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed))


def test_bad_inputs():
    with pytest.raises(UnsupportedModelError, match="not a transformers causal LM"):
        prepare_model(torch.nn.Linear(2, 2))
    with pytest.raises(UnsupportedModelError, match="neither a directory with config.json nor"):
        load_config("no-such-model")
    with pytest.raises(UnsupportedModelError, match="cannot be trained with FlexSP"):
        install("paged|eager")
    sp = prepare_model(build("llama"), max_seqlen=max(LENGTHS))
    with pytest.raises(ValueError, match="must be 1-D"):
        sp.shard_loss(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                      torch.ones(2, 3, dtype=torch.long), AttentionContext.single(6))
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_config_directory(tmp_path):
    config("qwen3").save_pretrained(tmp_path)
    cfg = load_config(tmp_path)
    assert cfg.model_type == "qwen3" and cfg.head_dim == 16


def test_gradient_checkpointing_keeps_the_context():
    """HF's activation checkpointing re-runs each layer with the same kwargs, context included."""
    ref = build("mistral")
    want_loss, want_grads = reference(ref, batch(0))
    model = copy.deepcopy(ref)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    sp = prepare_model(model, max_seqlen=max(LENGTHS))
    packed = pack(batch(0), 1)
    (sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed)) / sum(n - 1 for n in LENGTHS)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in sp.parameters()])
    assert float((grads - want_grads).abs().max() / want_grads.abs().max()) < 1e-7


def test_sp_never_silently_does_nothing(monkeypatch):
    """If a layer's attention does not come through FlexSP (here: the registry entry bypassed), the
    step fails naming the model, instead of training each rank on its shard alone."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import flexsp.hf.adapter as adapter_module

    sp = prepare_model(build("llama"), max_seqlen=max(LENGTHS))
    packed = pack(batch(0), 1)
    monkeypatch.setattr(adapter_module, "install", lambda key: None)
    plain = lambda module, q, k, v, mask, **kw: sdpa_attention_forward(module, q, k, v, None, **kw)  # noqa: E731
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", plain)
    with pytest.raises(UnsupportedModelError, match=r"LlamaForCausalLM .*0 of its 2 decoder layers ran FlexSP"):
        sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed))


def test_attention_key_switched_after_prepare():
    ref = build("qwen2")
    want_loss, _ = reference(ref, batch(0))
    sp = prepare_model(copy.deepcopy(ref), max_seqlen=max(LENGTHS))
    sp.model.set_attn_implementation("eager")
    packed = pack(batch(0), 1)
    loss = sp.shard_loss(packed.input_ids, packed.position_ids, packed.labels, _ctx(packed))
    assert float(loss) / sum(n - 1 for n in LENGTHS) == pytest.approx(want_loss, rel=1e-12)


def test_config_file_and_empty_directory(tmp_path):
    config("phi3").save_pretrained(tmp_path / "m")
    assert load_config(tmp_path / "m" / "config.json").model_type == "phi3"
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnsupportedModelError, match="no config.json in"):
        load_config(tmp_path / "empty")


def test_a_call_without_a_context_builds_its_bounds_where_the_tokens_are(monkeypatch):
    """``sp(input_ids, position_ids)`` (evaluation, logits): the one-sequence context's ``cu_seqlens`` on the tokens'
    device; on the host, a Gated DeltaNet layer would hand fla's CUDA kernel CPU bounds."""
    sp = prepare_model(build("llama"), max_seqlen=max(LENGTHS))
    seen, real = [], AttentionContext.single
    monkeypatch.setattr(AttentionContext, "single", classmethod(
        lambda cls, tokens, backend="auto", device=None: seen.append(device) or real(tokens, backend, device)))
    ids = torch.arange(1, 6)
    sp(ids, torch.arange(5))
    assert seen == [ids.device]


def test_under_autocast_the_kernels_get_the_autocast_dtype(monkeypatch):
    """An fp32 model under bf16 autocast (the Trainer's bf16=True): HF's rotary leaves q and k fp32 beside a bf16 v.
    The model's own path casts SDPA's inputs; FlexSP's attention casts all three, so the kernel rule sees bf16
    (fp32 would run per-sequence SDPA on a GPU, and an explicit flash or varlen backend would refuse it) and the
    all-to-all and ring hops carry bf16."""
    import flexsp.hf.attention as attention
    sp = prepare_model(build("llama").float(), max_seqlen=max(LENGTHS))
    seen, real = [], attention.sp_attention
    monkeypatch.setattr(attention, "sp_attention", lambda q, k, v, *a: seen.append((q.dtype, k.dtype, v.dtype))
                        or real(q, k, v, *a))
    ids = torch.arange(1, 17)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        sp(ids, torch.cat([torch.arange(10), torch.arange(6)]), AttentionContext.packed((0, 10, 16)))
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen)


def test_the_models_own_scale_goes_to_the_kernel_not_into_a_bf16_query():
    """Gemma 2's ``query_pre_attn_scalar`` (144 on head size 128) was folded into a bf16 ``q`` before the kernel,
    rounding ``q`` a second time: 4-5x the error of Hugging Face's own SDPA call, which passes ``scale=``."""
    import math

    import torch.nn.functional as F

    from flexsp.hf.attention import flexsp_attention
    from flexsp.runtime import AttentionContext
    from flexsp.runtime.kernels import attend
    torch.manual_seed(0)
    tokens, heads, dim, scaling = 512, 8, 128, 144 ** -0.5
    q, k, v = (torch.randn(1, heads, tokens, dim) * s for s in (3, 3, 1))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    truth = attend(*(t[0].transpose(0, 1).double() for t in (q, k, v)), (0, tokens), backend="reference", scale=scaling)
    ours, _ = flexsp_attention(torch.nn.Module(), q, k, v, None, AttentionContext.packed((0, tokens)), scaling=scaling)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)[0].transpose(0, 1)

    def error(x):
        return float((x.double() - truth).abs().max() / truth.abs().max())
    assert error(ours[0]) <= 1.5 * error(theirs), (error(ours[0]), error(theirs))
    assert math.isfinite(error(ours[0]))
