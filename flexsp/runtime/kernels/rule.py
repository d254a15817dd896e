"""Which kernel ``backend="auto"`` runs: a pure function of the device, the dtype, the head dim and the
micro-batch's length mix, so the choice is the same in every layer of a micro-batch and testable on CPU.

Inputs: ``DeviceFacts`` (device type, CUDA capability, cuDNN version, which kernels are installed and
usable there and whether torch's ``varlen_attn`` selects its backend, the dtypes they take) and ``LengthMix`` (non-empty sequences, tokens, longest) read from
the host bounds ``AttentionContext`` carries - never from a device tensor. ``choose`` decides, in order:

1. ``sdpa`` when the varlen/flash kernels cannot take the inputs: not fp16/bf16 (fp32 on CUDA runs SDPA's
   efficient/cuDNN kernel per call), head dim not a multiple of 8 or above 256, no CUDA (CPU: SDPA's fused
   flash kernel per sequence).
2. Hopper (sm90+) with FlashAttention-3 installed: ``flash`` (one launch; FA3 is Hopper's FA kernel).
3. sm90/sm100, head dim <= 128, cuDNN >= 9.18, a torch whose ``varlen_attn`` selects its backend by
   ``sdpa_kernel`` (``VarlenAPI.selects``, read from the installed torch: pytorch PR 193631), and a longest
   sequence past ``varlen.CUDNN_MIN_Q``: ``varlen_cudnn``, cuDNN's kernel in one launch with Flash enabled
   beside it. Each call still checks cuDNN's constraints on its own bounds (``varlen.cudnn_fits``) and runs
   Flash where they fail (the idle rank's one-token micro-batch, short ring blocks).
4. Hopper, head dim <= 128, few long sequences (at most ``FEW_SEQUENCES`` non-empty, mean length at least
   ``LONG_MEAN`` tokens): ``sdpa``, one ``is_causal`` SDPA call per sequence, where SDPA runs cuDNN
   attention. Measured on one H200 (torch 2.11, bf16, 32/8 heads, dim 128, fwd + bwd): 33,792 tokens
   [16K, 8K, 4K, 2K, 1K, 1K, 512, 512] took 22.7 ms per sequence vs 34.6 ms in ``varlen`` (FA2).
5. ``varlen`` (torch's FA2, one launch: many short sequences - 64 x 512 tokens is where one launch wins),
   else ``flash`` (FA2) if installed, else ``sdpa``.

The thresholds are the two measured shapes' boundary, not a sweep: re-measure on a GPU
(``experiments/gpu_step_benchmark.py``) before reading more into them. ``backend=`` overrides the rule;
an explicit kernel the device cannot run is refused with a named error. The ring's log-sum-exp form
(``lse_kernel``) follows the same choice where a kernel has an lse form with a merged-statistics backward:
``varlen``/``varlen_cudnn`` as chosen; ``flash`` and the per-sequence choice of step 4 -> ``varlen`` when
torch has it (the per-sequence lse form is an explicit softmax off CPU); else per sequence.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from flexsp.runtime.kernels import flash, varlen
from flexsp.runtime.kernels.layout import AttentionError

BACKENDS = ("auto", "varlen", "varlen_cudnn", "flash", "sdpa", "sdpa_each", "reference")
HALF = frozenset({torch.float16, torch.bfloat16})
HOPPER = (9, 0)
CUDNN_VARLEN_SINCE = 91800     # cuDNN version (torch.backends.cudnn.version()) torch's varlen cuDNN branch needs
CUDNN_MAJORS = (9, 10)         # sm90 / sm100: where that branch runs
CUDNN_HEAD_DIM = varlen.CUDNN_HEAD_DIM
FLASH_HEAD_DIM = 256           # FlashAttention-2/3
FEW_SEQUENCES = 16
LONG_MEAN = 2048


def _version(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


TORCH_VERSION = _version(torch.__version__)


@dataclass(frozen=True)
class DeviceFacts:
    """What the rule needs to know about the device and the installed kernels (faked in tests)."""

    device_type: str                            # "cuda", "cpu", ...
    capability: tuple[int, int] | None = None   # CUDA compute capability; None off CUDA or unknown
    torch_version: tuple[int, int] = TORCH_VERSION   # reported only: the choice reads features, not versions
    varlen: bool = False                        # torch's varlen_attn (a known signature) runs here
    flash: int = 0                              # flash-attn generation that runs here: 0 (none), 2, 3
    kernel_dtypes: frozenset = HALF             # dtypes the varlen/flash kernels take
    varlen_selects: bool = False                # varlen_attn picks its backend by sdpa_kernel (VarlenAPI.selects)
    cudnn: int = 0                              # cuDNN version here (0: none or unknown)

    @property
    def hopper(self) -> bool:
        return self.capability is not None and tuple(self.capability) >= HOPPER

    @property
    def cudnn_varlen(self) -> bool:
        """``varlen_attn`` can be asked for its cuDNN branch here: it selects by ``sdpa_kernel``, cuDNN is recent
        enough and the device is one that branch runs on."""
        return (self.varlen and self.varlen_selects and self.cudnn >= CUDNN_VARLEN_SINCE
                and self.capability is not None and self.capability[0] in CUDNN_MAJORS)

    def cudnn_missing(self) -> str:
        """What keeps ``varlen_cudnn`` off this device, in words ("" when nothing)."""
        missing = [text for lacks, text in (
            (not self.varlen, "torch's varlen_attn on CUDA"),
            (not self.varlen_selects, "a varlen_attn that selects its backend by sdpa_kernel (pytorch PR 193631)"),
            (self.cudnn < CUDNN_VARLEN_SINCE, f"cuDNN >= 9.18 (this is {self.cudnn or 'none'})"),
            (self.capability is None or self.capability[0] not in CUDNN_MAJORS, "an sm90/sm100 GPU"))
            if lacks]
        return ", ".join(missing)


@dataclass(frozen=True)
class LengthMix:
    """A micro-batch's sequence lengths, summarised: non-empty sequences, tokens, the longest."""

    sequences: int
    tokens: int
    longest: int

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(bounds: tuple[int, ...]) -> "LengthMix":
        """Summarised once per micro-batch: every layer (forward, backward recompute) asks with the same
        bounds, which at thousands of sequences would otherwise cost a Python pass per layer."""
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return LengthMix(len(lengths), sum(lengths), max(lengths, default=0))

    @property
    def few_long(self) -> bool:
        return 0 < self.sequences <= FEW_SEQUENCES and self.tokens >= LONG_MEAN * self.sequences


@functools.lru_cache(maxsize=256)
def choose(facts: DeviceFacts, dtype: torch.dtype, head_dim: int, mix: LengthMix | None) -> str:
    """The kernel ``auto`` runs (module docstring, steps 1-5); ``mix`` None: lengths unknown (no host bounds)."""
    if dtype not in facts.kernel_dtypes or head_dim % 8 or head_dim > FLASH_HEAD_DIM or not (facts.varlen or facts.flash):
        return "sdpa"
    cudnn = facts.hopper and head_dim <= CUDNN_HEAD_DIM
    if facts.hopper and facts.flash >= 3:
        return "flash"
    if cudnn and facts.cudnn_varlen and mix is not None and mix.longest > varlen.CUDNN_MIN_Q:
        return "varlen_cudnn"
    if cudnn and mix is not None and mix.few_long:
        return "sdpa"
    return "varlen" if facts.varlen else "flash"


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():     # fake CUDA tensors on a CPU build
        return None
    try:
        return tuple(torch.cuda.get_device_capability(index))
    except Exception:
        return None


def device_facts(device: torch.device | str | None = None) -> DeviceFacts:
    """The facts of ``device`` (None: CUDA if present, else CPU) and the kernels installed for it.

    The one seam tests patch to run the CUDA kernels' stand-ins on CPU tensors."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    api, vapi = flash.FLASH, (varlen.api() if on_cuda else None)   # varlen read only where it can run
    return DeviceFacts(device.type, _capability(device.index) if on_cuda else None, TORCH_VERSION,
                       varlen=on_cuda and vapi is not None,
                       flash=api.generation if on_cuda and api is not None else 0,
                       varlen_selects=on_cuda and vapi is not None and vapi.selects,
                       cudnn=_cudnn_version() if on_cuda else 0)


@functools.lru_cache(maxsize=1)
def _cudnn_version() -> int:
    try:
        return int(torch.backends.cudnn.version() or 0) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def flash_available(device: torch.device | str | None = None) -> bool:
    """flash-attn is installed and the tensors are (or would be) on CUDA."""
    return bool(device_facts(device).flash)


def varlen_available(device: torch.device | str | None = None) -> bool:
    """torch's own varlen FlashAttention can run: a known ``varlen_attn`` signature and CUDA tensors."""
    return device_facts(device).varlen


def resolve_backend(backend: str, q: torch.Tensor, bounds: Sequence[int] | None = None, *,
                    facts: DeviceFacts | None = None) -> str:
    """The kernel ``backend`` runs for ``q`` (``auto``: ``choose``; ``bounds``, host ints, give the length mix)."""
    if backend not in BACKENDS:
        raise AttentionError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    facts = device_facts(q.device) if facts is None else facts
    if backend == "auto":
        return choose(facts, q.dtype, int(q.shape[-1]), None if bounds is None else LengthMix.of(tuple(bounds)))
    takes = q.dtype in facts.kernel_dtypes
    if backend == "flash" and not (facts.flash and takes):
        raise AttentionError("attention backend 'flash' needs flash_attn installed and CUDA tensors in "
                             "float16/bfloat16; use backend='sdpa' or 'auto'")
    if backend in ("varlen", "varlen_cudnn") and not (facts.varlen and takes):
        raise AttentionError(f"attention backend {backend!r} needs CUDA tensors in float16/bfloat16 (torch's "
                             "varlen_attn); use backend='sdpa' or 'auto'")
    if backend == "varlen_cudnn" and not facts.cudnn_varlen:
        raise AttentionError(f"attention backend 'varlen_cudnn' needs {facts.cudnn_missing()}; use backend='varlen' "
                             f"or 'auto'")
    return backend


def lse_kernel(backend: str, q: torch.Tensor, bounds: Sequence[int] | None = None, *,
               facts: DeviceFacts | None = None) -> str:
    """The log-sum-exp kernel for ``backend`` (the ring's, ``attend_lse``'s): ``varlen``/``varlen_cudnn`` as
    resolved; ``flash``, and ``auto``'s per-sequence choice, through ``varlen`` where torch has it (flash-attn's
    merged-statistics backward is private, and the per-sequence lse form is an explicit softmax off CPU);
    else the per-sequence form (``sdpa``)."""
    facts = device_facts(q.device) if facts is None else facts
    kernel = resolve_backend(backend, q, bounds, facts=facts)
    if kernel in ("varlen", "varlen_cudnn", "reference"):
        return kernel
    if facts.varlen and q.dtype in facts.kernel_dtypes and (kernel == "flash" or backend == "auto"):
        return "varlen"
    return "sdpa"
