"""The runtime's public API names a wrong argument in one line where it is passed, instead of an
AttributeError deep in the first step or a silent cast (found by fuzzing the API)."""
import pytest

torch = pytest.importorskip("torch")

from flexsp.errors import FlexSPError, PlanError  # noqa: E402
from flexsp.plan.specs import ModelSpec  # noqa: E402
from flexsp.runtime import TrainConfig  # noqa: E402
from flexsp.runtime.fsdp import shard_model  # noqa: E402
from flexsp.runtime.models.tiny import TinyLM  # noqa: E402
from flexsp.runtime.pool import GroupPool  # noqa: E402
from flexsp.runtime.step import StepExecutor  # noqa: E402

SPEC = ModelSpec(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64)


@pytest.mark.parametrize("settings", [{"param_dtype": torch.int32}, {"reduce_dtype": torch.int64}])
def test_an_integer_compute_dtype_is_refused(settings):
    """Autocast drops an integer dtype with a warning and computes in fp32: the config asked for something
    else, so it is an error."""
    with pytest.raises(FlexSPError, match="must be a floating-point dtype"):
        TrainConfig(**settings)


def test_fp16_compute_is_refused_not_trained_without_loss_scaling():
    """The step normalises by the global batch's supervised tokens and does no loss scaling: in fp16 those
    gradients underflow (a review measured 12% zeros at 100,000 tokens), so fp16 is an error, not a silent loss."""
    with pytest.raises(FlexSPError, match="float16 needs loss scaling.*use torch.bfloat16 or torch.float32"):
        TrainConfig(param_dtype=torch.float16)
    half = TinyLM(SPEC).half()   # fp16 weights computing in their own dtype: the same underflow, not asked for by name
    with pytest.raises(FlexSPError, match="fp16 compute needs loss scaling"):
        StepExecutor(half, torch.optim.SGD(half.parameters(), lr=0.1), GroupPool(), param_dtype=None)


@pytest.mark.parametrize("degrees, message", [([1.9], "each pool degree must be an integer, got 1.9"),
                                              ([True], "each pool degree must be an integer, got True"),
                                              ("1", "pool degrees must be a collection of whole numbers")])
def test_pool_degrees_are_whole_numbers_not_truncated(degrees, message):
    with pytest.raises(PlanError, match=message):
        GroupPool(degrees=degrees)
    with pytest.raises(PlanError, match=r"a split is a \(ulysses, ring\) pair of ints, got \(1.5, 1\)"):
        GroupPool(splits=[(1.5, 1)])


def test_wrong_arguments_are_named_where_they_are_passed():
    model, pool = TinyLM(SPEC).double(), GroupPool()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kwargs, message in (({"config": "full"}, "config must be a flexsp.runtime.TrainConfig, got str"),
                            ({"cost": "x"}, "cost must be a flexsp.CostModel or None, got str")):
        with pytest.raises(FlexSPError, match=message):
            StepExecutor(model, opt, pool, **kwargs)
    with pytest.raises(FlexSPError, match="pool must be a flexsp.runtime.GroupPool, got NoneType"):
        StepExecutor(model, opt, None)
    with pytest.raises(FlexSPError, match="optimizer must be a torch optimizer"):
        StepExecutor(model, None, pool)
    with pytest.raises(FlexSPError, match="config must be a flexsp.runtime.TrainConfig, got str"):
        shard_model(model, "full")
    executor = StepExecutor(model, opt, pool)
    with pytest.raises(PlanError, match="the batch must be a sequence of rows"):
        executor.run_plan(None, None)
