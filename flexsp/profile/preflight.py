"""What ``flexsp profile`` settles before it sweeps: that the model's states fit the device at all, and
how long the sweep will take. Torch-free.

* ``check_states_fit``: the model states of ``sharding`` over ``num_gpus`` (``flexsp.plan.memory``, the
  formula the capacity uses after the sweep) must leave room for activations in the usable memory; if
  not, one ``CostModelError`` line names the smallest ``--num-gpus`` that would fit, instead of a sweep
  of minutes that ends in the same refusal.
* ``FIT_ERROR_LIMIT``: the compute fit's mean error above which the profile is refused (``--force`` writes it).
* ``sweep_flops`` / ``sweep_seconds``: before anything runs, the sweep's FLOPs over a matmul's FLOP/s
  (a lower bound: the model reaches a fraction of a bare matmul); after one timed run of its shortest
  length, every run scaled by its training FLOPs (``ModelSpec.training_flops``, the count behind MFU).
  Fixed per-run costs make short runs slower than their FLOPs say, so this is an over-estimate for the
  long lengths of a small model and close for a big one.
"""
from __future__ import annotations

from typing import Sequence

from flexsp.errors import CostModelError
from flexsp.plan.memory import activation_bytes_per_token, model_state_bytes, precision_for
from flexsp.plan.specs import ModelSpec

MAX_GPUS = 1 << 16
# Mean |relative error| of a compute fit above which ``flexsp profile`` refuses to write the profile (without
# --force): the paper's cost model is within 6% on A100s, a GPU profile fits within ~1%, a CPU one with one
# thread and the CPU clock within ~3%; above 10% the timings were disturbed (a shared machine, thread
# contention, the default torch threads: 57% mean error measured) and plans made with the fit would be too.
FIT_ERROR_LIMIT = 0.10


def _fits(spec: ModelSpec, num_gpus: int, sharding: str, usable_bytes: float) -> bool:
    # the capacity's own test: states plus one token's activations (analytic: the sweep has not measured it yet)
    return model_state_bytes(spec.params, num_gpus, sharding) + activation_bytes_per_token(
        spec, "none", precision_for(num_gpus, sharding)) <= usable_bytes


def fitting_gpus(spec: ModelSpec, sharding: str, usable_bytes: float) -> int | None:
    """The fewest GPUs whose ``sharding`` of ``spec``'s states fits ``usable_bytes`` each; None if none does."""
    if not _fits(spec, MAX_GPUS, sharding, usable_bytes):
        return None
    lo, hi = 1, MAX_GPUS   # states only shrink with more GPUs: bisect for the first that fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fits(spec, mid, sharding, usable_bytes) else (mid + 1, hi)
    return lo


def check_states_fit(spec: ModelSpec, memory_bytes: float, usable_fraction: float, sharding: str,
                     num_gpus: int) -> None:
    """Raise ``CostModelError`` (one line, with the ``--num-gpus`` that would fit) if the states do not fit."""
    usable = memory_bytes * usable_fraction
    if _fits(spec, num_gpus, sharding, usable):
        return
    states = model_state_bytes(spec.params, num_gpus, sharding)
    need = fitting_gpus(spec, sharding, usable)
    if need is not None:
        advice = (f"--num-gpus {need} would fit ({model_state_bytes(spec.params, need, sharding) / 2**30:.1f} GiB "
                  f"per GPU)")
    else:
        full = fitting_gpus(spec, "full", usable)
        advice = (f"no number of GPUs fits with sharding {sharding!r}" +
                  (f"; --sharding full --num-gpus {full} would" if full is not None else ""))
    raise CostModelError(
        f"{spec.name}'s model states ({spec.params / 1e9:.2f} B params) take {states / 2**30:.1f} GiB per GPU with "
        f"sharding {sharding!r} over {num_gpus} GPU(s), more than the usable {usable / 2**30:.1f} GiB "
        f"({usable_fraction:g} x {memory_bytes / 2**30:.1f} GiB): {advice}")


def sweep_flops(lengths: Sequence[int], runs_per_length: int, memory_lengths: Sequence[int], spec: ModelSpec) -> float:
    """FLOPs of the compute sweep and the memory profile's runs."""
    return spec.training_flops(lengths) * runs_per_length + spec.training_flops(memory_lengths)


def sweep_seconds(spec: ModelSpec, lengths: Sequence[int], runs_per_length: int, memory_lengths: Sequence[int],
                  first_length: int, first_seconds: float) -> float:
    """Seconds the compute sweep (``runs_per_length`` runs of each length) and the memory profile (one run
    of each ``memory_lengths``) take, from one run of ``first_length`` that took ``first_seconds``."""
    return first_seconds / spec.training_flops([first_length]) * sweep_flops(lengths, runs_per_length, memory_lengths,
                                                                          spec)


def duration(seconds: float) -> str:
    """``seconds`` for a person: 45 s, 12 min, 2.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
