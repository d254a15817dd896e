"""``ControlGroup`` in one process: the same answers a world of one would agree on; bad settings named."""
import pytest

pytest.importorskip("torch")

from flexsp.errors import FlexSPError  # noqa: E402
from flexsp.runtime.failures import ControlGroup  # noqa: E402


class _Boom(FlexSPError):
    pass


def test_a_world_of_one_agrees_with_itself():
    control = ControlGroup(timeout=5)
    assert not control.distributed and control.group is None
    assert control.any(True) and not control.any(False)
    assert control.gather({"x": 1}) == [{"x": 1}]
    control.check(None, what="loading")
    with pytest.raises(_Boom, match=r"^loading failed on rank 0: OSError: no disk$"):
        control.check("OSError: no disk", what="loading", error=_Boom)
    control.close()


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_a_timeout_must_be_positive(timeout):
    with pytest.raises(FlexSPError, match="timeout must be > 0"):
        ControlGroup(timeout)
