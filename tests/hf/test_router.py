"""A MoE router's load-balancing loss under FlexSP equals HF's own on the whole batch as one padded batch.

4 gloo ranks, fp64, every token supervised: one SGD step of a tiny Mixtral with ``output_router_logits``
under the heterogeneous family plan (degrees 4, 2, 1, an idle rank; padded shards; three micro-batches:
the statistics pre-pass; once more under FSDP2, ``shard_model(sharding="full")``) and under a one-micro-batch
plan (the statistics of the step's own forward), against ``model(input_ids, attention_mask, labels)`` on the right-padded batch. The step reports the
total and the auxiliary part apart."""
import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime.distributed import run_distributed  # noqa: E402

from flexsp import Group, MicroBatch, Plan  # noqa: E402
from flexsp.hf import UnsupportedModelError, prepare_model  # noqa: E402
from flexsp.hf.families import LENGTHS, LR, batch, heterogeneous_plan, native_step, tiny_model  # noqa: E402
from flexsp.hf.router import RouterLoss  # noqa: E402

RTOL = 1e-7   # fp64 against the fp64 recomputation of HF's loss (measured <= 1e-15 for the LM part)
HF_RTOL = 1e-6   # against HF's own .loss, whose LM part HF computes from fp32-cast logits

ONE_MICRO_BATCH = Plan(num_gpus=4, predicted_time=0.0, micro_batches=(MicroBatch((
    Group(ranks=(0, 1), seq_ids=(0, 1, 2)), Group(ranks=(2,), seq_ids=(3,)), Group(ranks=(3,), seq_ids=(4, 5, 6, 7)))),))


def _padded(sequences):
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask, torch.where(mask.bool(), ids, -100)


def _worker(rank, world, plans):
    from flexsp.runtime import GroupPool, StepExecutor, TrainConfig, shard_model
    pool = GroupPool()
    out = []
    for plan, sharding in plans:
        sp = prepare_model(tiny_model("mixtral", output_router_logits=True), max_seqlen=max(LENGTHS))
        config = TrainConfig(param_dtype=None, sharding=sharding, backend="sdpa")
        if sharding != "none":   # FSDP2: the statistics pre-pass must unshard the root as forward does
            shard_model(sp, config)
        with StepExecutor(sp, torch.optim.SGD(sp.parameters(), lr=LR), pool, config=config) as ex:
            result = ex.run_plan(Plan.from_dict(plan), batch())
        full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in sp.parameters()]
        out.append({"loss": result.loss, "aux": result.aux_loss,
                    "params": torch.cat([p.detach().reshape(-1) for p in full])})
    return out


@pytest.fixture(scope="module")
def runs():
    plans = [(heterogeneous_plan().to_dict(), "none"), (ONE_MICRO_BATCH.to_dict(), "none"),
             (heterogeneous_plan().to_dict(), "full")]
    return run_distributed(_worker, 4, plans, timeout=240)


def test_router_loss_equals_hf_on_the_padded_batch(runs):
    model = tiny_model("mixtral", output_router_logits=True)
    ids, mask, labels = _padded(batch())
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    want_loss, want = native_step(copy.deepcopy(model), batch())
    want_aux = model.router_aux_loss_coef * float(hf.aux_loss)
    assert want_aux > 1000 * RTOL * want_loss   # the term is really there (coef 0.001 x aux ~2), far above RTOL
    for rank_runs in runs:
        for run in rank_runs:
            assert run["loss"] == pytest.approx(float(hf.loss), rel=HF_RTOL)   # HF's own .loss
            assert run["loss"] == pytest.approx(want_loss, rel=RTOL)
            assert run["aux"] == pytest.approx(want_aux, rel=1e-6)   # HF sums router probabilities in fp32
            got = torch.as_tensor(run["params"])
            assert float((got - want).abs().max() / want.abs().max()) < RTOL


def test_dropping_the_router_term_would_be_seen(runs):
    """The comparison is not vacuous: the same step without the router term differs by more than 10 x RTOL."""
    model = tiny_model("mixtral", output_router_logits=True)
    _, with_aux = native_step(copy.deepcopy(model), batch())
    model.config.output_router_logits = False
    _, without = native_step(model, batch())
    assert float((with_aux - without).abs().max() / with_aux.abs().max()) > 10 * RTOL   # measured 3.8e-6


def test_router_rule_read_from_the_family_code():
    rule = RouterLoss.of(tiny_model("qwen2_moe", output_router_logits=True))
    assert rule is not None and (rule.num_experts, rule.top_k, rule.coef) == (4, 2, 0.001)
    assert RouterLoss.of(tiny_model("qwen2_moe")) is None   # output_router_logits off: nothing to add
    with pytest.raises(UnsupportedModelError, match="not the standard Switch-style load-balancing loss|calls "
                                                    "load_balancing_loss_func"):
        prepare_model(tiny_model("doge", output_router_logits=True), max_seqlen=max(LENGTHS))


def test_shard_loss_alone_refuses_to_drop_the_router_term():
    from flexsp.runtime import AttentionContext, pack
    sp = prepare_model(tiny_model("mixtral", output_router_logits=True), max_seqlen=max(LENGTHS))
    p = pack(batch()[:2], 1)
    with pytest.raises(UnsupportedModelError, match="router auxiliary loss over the whole batch"):
        sp.shard_loss(p.input_ids, p.position_ids, p.labels, AttentionContext.packed(p.cu_seqlens))


def test_the_router_flag_is_read_as_the_family_reads_it_and_a_later_change_is_refused():
    """A multimodal MoE class adds no router loss for its top config's flag (only its text config's): neither
    does FlexSP. Setting the flag after prepare_model, which transformers would honour on the next forward, is
    refused instead of silently training without (or with) the router loss."""
    from flexsp.hf.features import text_config
    from flexsp.runtime import AttentionContext, pack
    model = tiny_model("qwen3_5_moe")
    model.config.output_router_logits = True
    text_config(model).output_router_logits = False
    assert RouterLoss.of(model) is None
    sp = prepare_model(tiny_model("mixtral"), max_seqlen=max(LENGTHS))
    sp.model.config.output_router_logits = True
    shard = pack(batch()[:2], degree=1)
    with pytest.raises(UnsupportedModelError, match="output_router_logits changed to True after prepare_model"):
        sp(shard.input_ids, shard.position_ids, AttentionContext.packed(shard.cu_seqlens), labels=shard.labels)
