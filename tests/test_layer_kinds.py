"""Layer kinds and experts in ModelSpec, read from each transformers family's config, and their cost."""
import dataclasses
import json

import numpy as np
import pytest
import torch
import transformers as T

import flexsp
from flexsp.errors import CostModelError
from flexsp.plan.analytic import alltoall_elements, comm_bytes_per_token, cost_from_hardware
from flexsp.plan.layers import FULL, LatentShape, LayerKind, LinearShape, pairs, runs
from flexsp.plan.memory import activation_bytes_per_token, model_state_bytes
from flexsp.plan.specs import ModelSpec, get_model, spec_from_hf_config
from flexsp.replay.exchange import LocalExchange
from flexsp.runtime.sp.context import AttentionContext
from flexsp.runtime.sp.linear import ulysses_conv, ulysses_recurrence
from flexsp.runtime.sp.ulysses import ulysses_attention

SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def window(w, **kw):
    return LayerKind("window", w, **kw)


def per_layer(spec):
    return [(k.mixer, k.size, k.moe) for k in spec.layer_kinds]


# --- one test per family: the kinds and experts its config says -------------------------------------
def test_gemma2_alternates_window_and_full():
    spec = spec_from_hf_config(T.Gemma2Config(num_hidden_layers=4, intermediate_size=128, head_dim=16,
                                              sliding_window=32, **SMALL))
    assert per_layer(spec) == [("window", 32, False), ("full", 0, False)] * 2


def test_gemma3_five_windows_to_one_full_also_inside_the_multimodal_config():
    text = dict(num_hidden_layers=12, intermediate_size=128, head_dim=16, sliding_window=32, **SMALL)
    for config in (T.Gemma3TextConfig(**text), T.Gemma3Config(text_config=text)):
        spec = spec_from_hf_config(config)
        assert per_layer(spec) == ([("window", 32, False)] * 5 + [("full", 0, False)]) * 2
        assert len(spec.kinds) == 4          # runs, not one record per layer


def test_gpt_oss_windows_sinks_and_experts():
    spec = spec_from_hf_config(T.GptOssConfig(num_hidden_layers=4, intermediate_size=96, head_dim=16,
                                              sliding_window=8, num_local_experts=8, num_experts_per_tok=2, **SMALL))
    assert per_layer(spec) == [("window", 8, True), ("full", 0, True)] * 2
    assert all(k.sinks for k in spec.layer_kinds)
    assert (spec.experts, spec.active_experts, spec.moe_ffn, spec.shared_ffn) == (8, 2, 96, 0)


def test_qwen3_5_three_linear_to_one_full_with_linear_heads():
    spec = spec_from_hf_config(T.Qwen3_5TextConfig(
        num_hidden_layers=8, intermediate_size=128, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, **SMALL))
    assert [k.mixer for k in spec.layer_kinds] == ["linear"] * 3 + ["full"] + ["linear"] * 3 + ["full"]
    assert spec.linear == LinearShape(2, 4, 8, 16, 4) and spec.attn_gate
    assert spec.ulysses_heads == 2               # gcd of 4 attention, 2 key and 4 value heads


def test_qwen3_next_linear_moe_shared_expert_and_dense_layers():
    spec = spec_from_hf_config(T.Qwen3NextConfig(
        num_hidden_layers=4, intermediate_size=128, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, mlp_only_layers=[0], **SMALL))
    assert per_layer(spec) == [("linear", 0, False), ("linear", 0, True), ("linear", 0, True), ("full", 0, True)]
    assert (spec.experts, spec.active_experts, spec.moe_ffn, spec.shared_ffn) == (8, 2, 32, 48)


def test_qwen3_moe_sparse_step():
    spec = spec_from_hf_config(T.Qwen3MoeConfig(num_hidden_layers=4, intermediate_size=128, num_experts=8,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                decoder_sparse_step=2, **SMALL))
    assert per_layer(spec) == [("full", 0, False), ("full", 0, True)] * 2
    assert (spec.ffn, spec.moe_ffn) == (128, 32)


def test_mixtral_every_layer_moe():
    spec = spec_from_hf_config(T.MixtralConfig(num_hidden_layers=2, intermediate_size=128, num_local_experts=4,
                                               num_experts_per_tok=2, **SMALL))
    assert per_layer(spec) == [("full", 0, True)] * 2 and (spec.experts, spec.active_experts) == (4, 2)


def test_mistral_sliding_window_everywhere():
    spec = spec_from_hf_config(T.MistralConfig(num_hidden_layers=2, intermediate_size=128, sliding_window=16,
                                               **SMALL))
    assert per_layer(spec) == [("window", 16, False)] * 2


def test_deepseek_v3_first_dense_then_routed_and_shared():
    spec = spec_from_hf_config(T.DeepseekV3Config(
        num_hidden_layers=4, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=2, topk_group=1, **SMALL))
    assert per_layer(spec) == [("full", 0, False)] + [("full", 0, True)] * 3
    assert (spec.experts, spec.active_experts, spec.moe_ffn, spec.shared_ffn, spec.head_size) == (8, 2, 32, 32, 24)


def test_llama4_chunks_nope_layers_and_interleaved_moe():
    spec = spec_from_hf_config(T.Llama4TextConfig(
        num_hidden_layers=8, intermediate_size=32, intermediate_size_mlp=128, head_dim=16, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, **SMALL))
    assert per_layer(spec) == [("chunk", 16, False), ("chunk", 16, True), ("chunk", 16, False), ("full", 0, True)] * 2
    assert [k.rope for k in spec.layer_kinds] == [True, True, True, False] * 2
    assert (spec.ffn, spec.moe_ffn, spec.shared_ffn) == (128, 32, 32)


def test_dense_llama_config_keeps_the_old_spec():
    spec = spec_from_hf_config(T.LlamaConfig(num_hidden_layers=2, intermediate_size=128, **SMALL))
    assert spec.kinds == () and spec.is_dense_full and spec.layer_kinds == (FULL, FULL)


# --- defaults and bad input ------------------------------------------------------------------------
def test_existing_constructions_are_dense_full_attention():
    spec = ModelSpec(32, 4096, 32, 8, 14336, 128256)
    assert spec.kinds == () and spec.kind_counts() == {FULL: 32} and spec.active_params == spec.params
    per_layer_params = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336   # the formula before kinds
    assert spec.params == 32 * per_layer_params + 2 * 4096 * 128256
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.layers = 3


@pytest.mark.parametrize("make,message", [
    (lambda: ModelSpec(4, 64, 4, 2, 128, 256, kinds=((window(8), 3),)), "cover 3 layers but the model has 4"),
    (lambda: LayerKind("window", 0), "window of at least 1 token"),
    (lambda: LayerKind("chunk", -4), "chunk of at least 1 token"),
    (lambda: LayerKind("mamba"), "not one of"),
    (lambda: ModelSpec(2, 64, 4, 2, 128, 256, experts=4, active_experts=5), "active_experts must be 1 to experts"),
    (lambda: ModelSpec(2, 64, 4, 2, 128, 256, kinds=((LayerKind(moe=True), 2),)), "experts >= 1"),
    (lambda: ModelSpec(2, 64, 4, 2, 128, 256, active_experts=2), "no layer is MoE"),
    (lambda: spec_from_hf_config(T.Gemma2Config(num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                                                sliding_window=None, **SMALL)), "sliding_window is not set"),
])
def test_bad_layer_input_is_one_line(make, message):
    with pytest.raises(CostModelError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_unknown_hf_layer_type_is_named():
    config = T.Qwen3_5TextConfig(num_hidden_layers=2, intermediate_size=128, head_dim=16, **SMALL)
    config.layer_types = ["mamba", "full_attention"]
    with pytest.raises(CostModelError, match="layer 0 is 'mamba'"):
        spec_from_hf_config(config)


# --- attention pairs and the cost per kind ---------------------------------------------------------
def brute_pairs(s, keys):
    return sum(2 * keys(p) - 1 for p in range(s))


@pytest.mark.parametrize("s", [1, 7, 8, 9, 100, 257])
def test_pairs_are_the_exact_count(s):
    assert pairs(s, "full") == s * s == brute_pairs(s, lambda p: p + 1)
    assert pairs(s, "window", 8) == brute_pairs(s, lambda p: min(p + 1, 8))
    assert pairs(s, "chunk", 8) == brute_pairs(s, lambda p: p % 8 + 1)
    assert pairs(s, "linear") == 0


def cost_with_window(**extra):
    values = dict(alpha1=1e-9, alpha2=1e-5, beta1=0.01, comm_bytes_per_token=1e5,
                  alltoall_bandwidth={2: 1e11, 4: 1e11, 8: 1e11}, token_capacity=40_000)
    return flexsp.CostModel(**{**values, **extra})


def test_window_and_chunk_terms_in_seq_time_and_the_solver_view():
    cost = cost_with_window(window_alpha={1024: 4e-9}, chunk_alpha={"512": 2e-9})
    s = np.array([10, 1024, 5000, 30_000])
    for d in (1, 2, 8):
        quad, lin, _ = cost.coefficients(d)
        expected = lin * s + quad * s * s + (4e-9 * pairs(s, "window", 1024) + 2e-9 * pairs(s, "chunk", 512)) / d
        assert cost.seq_time(s, d) == pytest.approx(expected, rel=1e-12)
        costs = cost.degree_costs([1, 2, 8])
        assert costs.seconds(s, costs.index(d)) == pytest.approx(expected, rel=1e-12)
    assert flexsp.CostModel.from_dict(json.loads(json.dumps(cost.to_dict()))) == cost
    assert "window_alpha" not in cost_with_window().to_dict()        # older files and dense models unchanged


def test_bad_window_table_is_named():
    with pytest.raises(CostModelError, match="window_alpha has size 0"):
        cost_with_window(window_alpha={0: 1e-9})


def test_plans_use_the_window_terms():
    """The solver plans on the windowed cost: its prediction is the model's time, and a windowed model puts
    long sequences at smaller degrees than its full-attention twin."""
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(100, 3000, 60), [30_000, 60_000]]).tolist()
    cluster = flexsp.Cluster(num_gpus=8, gpus_per_node=8)
    full = cost_with_window(alpha1=5e-9)
    windowed = dataclasses.replace(full, alpha1=0.0, window_alpha={512: 5e-9})
    plan = flexsp.plan_batch(lengths, windowed, cluster, time_limit=5)
    assert plan.predicted_time == pytest.approx(plan.time(lengths, windowed), rel=1e-9)
    dense_plan = flexsp.plan_batch(lengths, full, cluster, time_limit=5)
    assert plan.predicted_time < 0.5 * dense_plan.predicted_time
    longest = int(np.argmax(lengths))
    degree = {i: g.degree for mb in plan.micro_batches for g in mb.groups for i in g.seq_ids}
    dense_degree = {i: g.degree for mb in dense_plan.micro_batches for g in mb.groups for i in g.seq_ids}
    assert degree[longest] <= dense_degree[longest]


def test_analytic_moe_compute_from_active_states_from_all():
    dense = get_model("gpt-oss-20b")
    cost = cost_from_hardware(dense, "h100-80gb", 64)
    gpu = flexsp.plan.specs.get_gpu("h100-80gb")
    flops = gpu.peak_flops * gpu.efficiency
    assert cost.alpha2 == pytest.approx(3 * 2 * dense.linear_params / flops)
    assert dense.active_params < 0.25 * dense.params
    free = gpu.memory_bytes * gpu.usable_memory - model_state_bytes(dense.params, 64, "full")
    assert cost.token_capacity == int(free // activation_bytes_per_token(dense, "none", "bf16"))
    # half the layers are 128-token windows, the other half full attention
    assert cost.window_alpha == {128: pytest.approx(cost.alpha1)}


class _Counting(LocalExchange):
    """One rank's stand-in all-to-all that counts the elements this rank sends (its shard of each tensor)."""

    sent: int = 0

    def seq_to_head(self, x):
        self.sent += x.numel()
        return super().seq_to_head(x)

    def head_to_seq(self, x):
        self.sent += x.numel()        # [tokens, heads/d, dim]: as many elements as the shard it becomes
        return super().head_to_seq(x)


def _sent_per_token(degree: int, run) -> float:
    """Elements per token one rank of a ``degree`` group sends through ``run(ctx, tokens)``'s all-to-alls."""
    tokens = 8 * degree
    exchange = _Counting(degree, 0)
    ctx = dataclasses.replace(AttentionContext.packed([0, tokens]), exchange=exchange)
    run(ctx, tokens // degree)
    return exchange.sent / (tokens // degree)


LATENT = ModelSpec(2, 64, 8, 8, 128, 100, name="latent", head_dim=12, latent=LatentShape(8, 8, 8, 4, 8))


@pytest.mark.parametrize("name", ["qwen3.5-27b", "llama3-8b", "gpt-oss-20b", "latent"])
def test_alltoall_volume_is_what_the_runtime_sends(name):
    """The cost model's all-to-all bytes per layer kind and Ulysses degree equal the elements the runtime's
    Ulysses attention and Gated DeltaNet paths send (counted through a stand-in exchange): the convolution's
    round trip, the heads copied past the kv heads (GQA) or the linear layers' key heads, and latent attention's
    narrower v (on the wire at its own width) included."""
    spec = LATENT if name == "latent" else get_model(name)
    degrees = [u for u in (2, 4, 8, 16, 32, 64) if spec.ulysses_heads % u == 0]
    cost = cost_from_hardware(spec, "h100-80gb", 64)
    for u in degrees:
        def softmax(ctx, n):
            q = torch.zeros(n, spec.heads, spec.head_size)
            k = torch.zeros(n, spec.kv_heads, spec.head_size)
            ulysses_attention(q, k, torch.zeros(n, spec.kv_heads, spec.v_head_size), ctx)

        per_token = spec.softmax_layers * _sent_per_token(u, softmax)
        if spec.mixer_layers("linear"):
            shape = spec.linear_shape

            def linear(ctx, n):
                channels = 2 * shape.key_width + shape.value_width
                ulysses_conv(torch.zeros(n, channels), [torch.zeros(channels, shape.conv), None], ctx,
                             lambda xs, w, b: xs)
                q = torch.zeros(n, shape.k_heads, shape.k_dim)
                v, g = torch.zeros(n, shape.v_heads, shape.v_dim), torch.zeros(n, shape.v_heads)
                ulysses_recurrence(q, torch.zeros_like(q), v, g, torch.zeros_like(g), ctx, lambda q, k, v, g, b: v)

            per_token += spec.mixer_layers("linear") * _sent_per_token(u, linear)
        assert alltoall_elements(spec, u) == per_token, (name, u)
        # fwd + bwd in bf16; the heads copied past the kv heads as cost.alltoall_replication
        assert cost.alltoall_bytes(u) == pytest.approx(2 * 2 * per_token)
    assert comm_bytes_per_token(spec) == 2 * 2 * alltoall_elements(spec)


def test_linear_layers_have_no_pair_term_nor_ring():
    spec = get_model("qwen3.5-27b")
    cost = cost_from_hardware(spec, "h100-80gb", 64)
    dense_twin = dataclasses.replace(spec, kinds=(), linear=None)
    assert cost.alpha1 == pytest.approx(cost_from_hardware(dense_twin, "h100-80gb", 64).alpha1 / 4)
    # its recurrences cannot run on a ring (flexsp.runtime.sp.linear): degrees past its 8 heads are not costed,
    # so no plan puts it on a ring group
    assert cost.heads == 8 and cost.ring_bandwidth is None
    assert not cost.costs_degree(16) and cost.costs_degree(8)
    plan = flexsp.plan_batch([20_000] * 4 + [500] * 64, cost, flexsp.Cluster(64, 8), "flexsp")
    assert all(g.ring == 1 and g.degree <= 8 for mb in plan.micro_batches for g in mb.groups)


def test_layer_kinds_per_layer_view_and_runs_roundtrip():
    kinds = [window(4), window(4), FULL, LayerKind("linear"), LayerKind("linear")]
    spec = ModelSpec(5, 64, 4, 2, 128, 256, kinds=runs(kinds))
    assert list(spec.layer_kinds) == kinds and len(spec.kinds) == 3
    assert runs([FULL] * 3) == ()
    assert spec.attention_pairs([10]) == 2 * pairs(10, "window", 4) + 100


@pytest.mark.parametrize("terms", [{"window_alpha": {300: 6e-9}}, {"chunk_alpha": {256: 6e-9}}])
def test_bounds_stay_below_plans_with_window_and_chunk_terms(terms):
    """Chunked attention's work per token dips just past each chunk, so the bounds cost buckets at a rate
    floor; neither bound may exceed a valid plan's time."""
    from flexsp.plan.bounds import coupled_lower_bound, lower_bound
    rng = np.random.default_rng(3)
    lengths = np.concatenate([rng.integers(200, 700, 120), rng.integers(2000, 9000, 8)]).tolist()
    cost = cost_with_window(alpha1=0.0, token_capacity=6000, **terms)
    cluster = flexsp.Cluster(num_gpus=8, gpus_per_node=8)
    plan = flexsp.plan_batch(lengths, cost, cluster, time_limit=5)
    plan.validate(lengths, cost, cluster)
    assert max(lower_bound(lengths, cost, cluster), coupled_lower_bound(lengths, cost, cluster)) <= plan.predicted_time


def test_the_bounds_rate_floor_never_exceeds_a_longer_sequences_rate():
    """Chunked work per token dips just past a chunk (9 tokens on chunks of 8 cost less per token than 8): the
    rate the bounds cost a bucket at, its shortest length's under ``_rate_floor``, stays below every longer one."""
    from flexsp.plan.bounds import _rate_floor
    cost = cost_with_window(alpha1=0.0, alpha2=1e-12, chunk_alpha={8: 1e-9}, window_alpha={5: 1e-9})
    costs = cost.degree_costs([1, 2])
    s = np.arange(1, 200, dtype=np.float64)
    true_rate = costs.seconds(s, 0) / s
    floor_rate = _rate_floor(costs).seconds(s, 0) / s
    assert np.all(floor_rate <= np.minimum.accumulate(true_rate[::-1])[::-1] * (1 + 1e-12))
    assert true_rate[8] < true_rate[7]          # the dip the floor is for


def test_with_layers_keeps_the_pattern_and_drops_experts_only_when_no_layer_is_moe():
    gpt_oss = get_model("gpt-oss-20b").with_layers(3)
    assert [k.mixer for k in gpt_oss.layer_kinds] == ["window", "full", "window"] and gpt_oss.experts == 32
    deepseek_like = ModelSpec(4, 64, 4, 2, 128, 256, kinds=runs([FULL] + [LayerKind(moe=True)] * 3), experts=8,
                              active_experts=2)
    dense_head = deepseek_like.with_layers(1)
    assert dense_head.kinds == () and dense_head.experts == 0 and dense_head.params < deepseek_like.params
    assert get_model("qwen3.5-27b").with_layers(0).kinds == ()
    assert ModelSpec(2, 64, 4, 2, 128, 256).with_layers(5).kinds == ()


def test_simulate_names_the_layer_kinds_of_an_analytic_preset(capsys):
    from flexsp.cli import main
    assert main(["simulate", "--model", "gemma-3-27b", "--gpus", "8", "--steps", "1", "--batch-size", "16",
                 "--strategies", "flexsp", "--quiet", "--time-limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "layers: 52 window 1024, 10 full" in out and "analytic" in out


# --- what the spec counts against what transformers builds ----------------------------------------
def _matrices(config) -> int:
    """Weights of >= 2 dimensions (norms and biases, which the spec leaves out, are 1-D) of the model built
    on the meta device: every family at its published default size, in a moment."""
    import torch
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.dim() >= 2)


@pytest.mark.parametrize("config", [
    T.LlamaConfig(), T.Gemma2Config(), T.Gemma3TextConfig(), T.GptOssConfig(), T.MixtralConfig(), T.Qwen3MoeConfig(),
    T.Qwen3NextConfig(), T.Qwen3_5TextConfig(), T.Llama4TextConfig(),
    T.DeepseekV3Config(), T.MiniCPM3Config(),                                          # latent attention
    T.Starcoder2Config(), T.GPTNeoXConfig(), T.PhiConfig(), T.ApertusConfig(), T.GPT2Config(),   # two-matrix MLPs
    T.FalconConfig(),                                                                   # multi-query
    T.FalconConfig(new_decoder_architecture=True, num_attention_heads=16, num_kv_heads=8, hidden_size=1024,
                   num_hidden_layers=4),                                                # grouped (Falcon-40B)
    # each family's own rule for which layers are MoE and how wide its shared experts are (every layer was costed
    # as MoE, shared experts under other names as absent, Aria as dense)
    T.AutoConfig.for_model("glm4_moe_lite", num_hidden_layers=4),                       # mlp_layer_types
    T.AutoConfig.for_model("laguna", num_hidden_layers=4, mlp_layer_types=["dense", "dense", "sparse", "dense"]),
    T.AutoConfig.for_model("exaone_moe", num_hidden_layers=4, mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
    T.AutoConfig.for_model("afmoe", num_hidden_layers=4, num_dense_layers=2, layer_types=["sliding_attention"] * 4),
    T.AutoConfig.for_model("ernie4_5_moe", num_hidden_layers=6, moe_layer_start_index=1, moe_layer_interval=2),
    T.AutoConfig.for_model("hy_v3", num_hidden_layers=4), T.AutoConfig.for_model("aria_text", num_hidden_layers=2),
    T.AutoConfig.for_model("minimax_m3_vl_text", num_hidden_layers=2),                  # shared_intermediate_size
], ids=lambda c: c.model_type)
def test_parameters_are_those_transformers_builds(config):
    """Model states follow ``params``: DeepSeek's latent attention read as plain attention (x3.8 its attention
    weights), a two-matrix MLP as gate-up-down (x1.3-1.6) and Falcon's one kv head as 71 were silently off."""
    spec = spec_from_hf_config(config)
    assert spec.params == pytest.approx(_matrices(config), rel=0.01)   # GPT-2's learned positions: 0.6%


def _forward_flops(config, length: int) -> float:
    """Forward FLOPs of a tiny model's eager forward (torch's counter), the score and PV matmuls' upper
    (non-causal) halves taken off: what a causal kernel does."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(0, config.vocab_size, (1, length)))
    spec = spec_from_hf_config(config)
    return counter.get_total_flops() - spec.softmax_layers * 2 * spec.attention_width * length * length


@pytest.mark.parametrize("config", [
    T.DeepseekV3Config(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                       n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                       qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_group=2, topk_group=1,
                       hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                       vocab_size=128),
    # transformers runs every Llama 4 expert on every token: the compute is all experts', not top-1's
    T.Llama4TextConfig(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=112,
                       interleave_moe_layer_step=2, attention_chunk_size=4096, hidden_size=64,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                       vocab_size=128),
], ids=lambda c: c.model_type)
def test_forward_flops_are_what_the_model_computes(config):
    measured = _forward_flops(config, 48)
    assert spec_from_hf_config(config).training_flops([48]) / 3 == pytest.approx(measured, rel=0.01)


def test_registered_analytic_models_are_their_published_configs():
    """The registry's Gemma-3-27B and Qwen3.5-27B are what spec_from_hf_config reads from their configs (their q/k
    norms were missing: 3-13% more tokens per GPU than fit)."""
    gemma = T.Gemma3TextConfig(hidden_size=5376, num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                               head_dim=128, intermediate_size=21504, vocab_size=262208, sliding_window=1024)
    qwen = T.Qwen3_5TextConfig(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                               head_dim=256, intermediate_size=17408, vocab_size=248320, linear_num_key_heads=16,
                               linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128)
    for name, config in (("gemma-3-27b", gemma), ("qwen3.5-27b", qwen)):
        mine, read = get_model(name), spec_from_hf_config(config)
        fields = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_size", "tie_embeddings", "kinds",
                  "qk_norm", "attn_gate", "linear", "experts", "latent", "gated_ffn")
        assert {f: getattr(mine, f) for f in fields} == {f: getattr(read, f) for f in fields}, name


@pytest.mark.parametrize("config,message", [
    (T.Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=0, **SMALL), "decoder_sparse_step must be an integer >= 1"),
    (T.Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[5], **SMALL), r"mlp_only_layers \[5\] name layers outside"),
    (T.DeepseekV2Config(num_hidden_layers=2, **SMALL), "num_experts_per_tok is not set"),
])
def test_bad_moe_layout_in_a_config_is_one_line(config, message):
    with pytest.raises(CostModelError, match=message) as info:
        spec_from_hf_config(config)
    assert "\n" not in str(info.value)


def test_an_mlp_layer_type_flexsp_does_not_know_is_named():
    config = T.AutoConfig.for_model("laguna", num_hidden_layers=2)
    config.mlp_layer_types = ["dense", "weird"]   # transformers checks its own; a config.json read loosely may not
    with pytest.raises(CostModelError, match=r"mlp_layer_types must list 2 of .* got 2 entries with \['weird'\]"):
        spec_from_hf_config(config)


@pytest.mark.parametrize("head_dim", [0, -16, 16.5, True])
def test_a_bad_head_dim_is_one_line(head_dim):
    with pytest.raises(CostModelError, match="head_dim must be an integer >= 1") as info:
        ModelSpec(2, 64, 4, 2, 128, 256, head_dim=head_dim)
    assert "\n" not in str(info.value)


def test_linear_attention_layers_other_than_gated_deltanet_are_one_line():
    """Jamba's ``linear_attention`` layers are Mamba, with none of Gated DeltaNet's head fields."""
    with pytest.raises(CostModelError, match="linear_attention layers have no linear_num_key_heads.*not jamba's"):
        spec_from_hf_config(T.JambaConfig())


def test_a_ringless_model_pools_and_pins_only_the_degrees_it_runs():
    """Qwen3.5 (no ring axis: linear attention) on 64 GPUs: the communicator pool holds what its plans use (1-8,
    not up to 64), and a pinned pure-Ulysses degree that is not a power of two (24 of 24 heads) stays usable."""
    from flexsp.plan.communicator_memory import pool_degrees
    from flexsp.plan.config import PlanConfig
    cluster = flexsp.Cluster(64, 8)
    cost = cost_from_hardware("qwen3.5-27b", "h100-80gb", 64)
    assert pool_degrees(cluster, "flexsp", None, None, cost) == (1, 2, 4, 8)
    assert pool_degrees(cluster, "static", None, None, cost) == (8,)
    wide = dataclasses.replace(cost_from_hardware(ModelSpec(8, 3072, 24, 8, 8192, 32000), "h100-80gb", 64),
                               ring_bandwidth=None, ring_bytes_per_token=0.0, ring_hop_latency=0.0)
    for ulysses_only in (False, True):
        config = PlanConfig(strategy="static", sp_degree=24, ulysses_only=ulysses_only).checked(wide, cluster)
        assert 24 in config.degrees and 16 not in config.degrees
        plan = flexsp.plan_batch([4000] * 64, wide, cluster, "static", sp_degree=24, ulysses_only=ulysses_only)
        assert {g.degree for mb in plan.micro_batches for g in mb.groups} == {24}
