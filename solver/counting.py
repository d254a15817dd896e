"""Finding a micro-batch count without trying each count in turn, under a deadline.

A batch may need one micro-batch or thousands; stepping the count up from the memory bound and
re-packing every micro-batch each time is quadratic in the count. ``search_count`` gallops up
from the bound and bisects the last step: O(log(answer - bound)) feasibility checks.
"""
from __future__ import annotations

import time
from typing import Callable


class OutOfTime(Exception):
    """Raised by a feasibility check when the deadline has passed; the caller keeps its plan so far."""


def check_deadline(deadline: float | None) -> None:
    """Raise ``OutOfTime`` once ``time.perf_counter()`` is past ``deadline`` (None: never)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise OutOfTime


def search_count(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """A count in ``[lo, hi]`` for which ``fits`` holds, near the smallest: gallop up from ``lo``
    (steps 1, 2, 4, ...), then bisect the last step; ``hi`` is returned even if ``fits(hi)`` is
    false (it is the caller's known fallback). O(log(answer - lo)) calls. ``fits`` need not be monotone; the answer then is a count that fits, not the least."""
    lo = max(1, min(lo, hi))
    if fits(lo):
        return lo
    step, bad = 1, lo
    while True:
        probe = min(bad + step, hi)
        if fits(probe) or probe == hi:
            good = probe
            break
        bad, step = probe, 2 * step
    while good - bad > 1:
        mid = (bad + good) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
