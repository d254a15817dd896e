"""Test glue: ``flexsp.hf.families.check_family`` for several model types on 4 gloo ranks (one process group
pool per rank), and the exactness assertion every family test makes of its results."""
from __future__ import annotations

from typing import Any, Sequence

from runtime.distributed import run_distributed

from flexsp.hf.families import RTOL


def _worker(rank: int, world: int, model_types: tuple[str, ...]) -> dict[str, Any]:
    from flexsp.hf.families import check_family
    from flexsp.runtime import GroupPool
    pool = GroupPool()
    return {t: check_family(t, pool) for t in model_types}


def family_results(model_types: Sequence[str], timeout: float = 300) -> list[dict[str, Any]]:
    """Each rank's ``{model type: FamilyResult}``."""
    return run_distributed(_worker, 4, tuple(model_types), timeout=timeout)


def assert_exact(results: list[dict[str, Any]], model_type: str) -> None:
    """Every rank found ``model_type`` exact: loss and update within ``RTOL`` of the native model."""
    for res in results:
        r = res[model_type]
        assert r.status == "exact", r
        assert r.loss_rel <= RTOL and r.update_rel <= RTOL
