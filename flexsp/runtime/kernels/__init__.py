"""Local attention over packed sequences, and the log-sum-exp form the ring axis merges.

Two entry points share one set of kernels:

* ``attend(q, k, v, cu_seqlens, *, max_seqlen, bounds, features, sinks)`` - causal within each packed
  sequence, never across; plus the layer's optional left window, chunking, score softcap (``Features``)
  and per-head sink logits.
* ``attend_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal)`` -
  queries and keys with their own bounds (sequence ``i`` of q attends to sequence ``i`` of k), returning
  ``(out, lse)`` so partial results over disjoint key sets combine exactly with ``merge_partials``.
  Differentiable through both outputs.

One module per job:

=================  =================================================================================
``dispatch``       ``attend``: the rule's kernel under the padding contract
``lse``            ``attend_lse``, ``lse_forward``/``lse_backward`` (the ring's), ``merge_partials``
``rule``           which kernel ``auto`` runs (device, torch, head dim, length mix); ``backend=`` overrides
``padding``        the contract: rows outside ``cu_seqlens`` are unspecified in every kernel; exactly zero
                   output, lse ``-inf`` and q/k/v gradient there, enforced once for every path
``varlen``         torch's ``varlen_attn`` (FA2; its cuDNN variant ``varlen_cudnn``), API across releases
``flash``          flash-attn 2/3 varlen (optional)
``sdpa``           per-sequence SDPA (``sdpa``: equal adjacent lengths batched; ``sdpa_each``), lse forms
``reference``      explicit softmax per sequence and the ``T x T`` mask (tests only)
``layout``         shape and bounds checks (host metadata only), ``LseSpec``
``features``       a layer's window, chunk and softcap (``Features``), and chunk-cut bounds
``sinks``          per-head sink logits as an exact lse correction (``with_sinks``) and its backward pair
``capability``     which kernel computes a layer's features (the rule's, or a documented fallback)
=================  =================================================================================

``sdpa`` is exact and its work and memory scale with ``sum(s^2)``, never with the packed stream's ``T^2``.
No kernel builds a ``T x T`` mask.

Layouts: ``q [tokens, heads, dim]``, ``k``/``v`` ``[tokens_k, kv_heads, dim]`` with heads % kv_heads == 0
(query head ``h`` uses kv head ``h // (heads // kv_heads)``). ``cu_seqlens`` is ``[n+1]`` int bounds: a
tuple, or an int32 tensor. ``varlen``/``flash`` never read a device tensor on the host (``max_seqlen``
must be given), so a CUDA step never waits on the GPU. The per-sequence ``sdpa`` kernels need the bounds
as host ints: ``bounds=`` (``AttentionContext`` carries them), a tuple, or a CPU tensor (free to read);
a device tensor without ``bounds`` is refused rather than silently synchronising every layer.
Tokens past ``cu_seqlens[-1]`` are padding: their output is zero, their lse ``-inf``, and they get exactly
zero gradient. ``lse`` is ``[heads, tokens_q]``, float32 (float64 for float64 inputs); a row that attends
to no key has ``out = 0`` and ``lse = -inf``. With ``causal`` and unequal q/k lengths the mask is
bottom-right aligned (flash-attn's convention): query ``i`` of ``Lq`` sees key ``j`` of ``Lk`` iff
``Lk - j >= Lq - i``.

The installed kernels are read into ``flash.FLASH`` at import and into ``varlen.VARLEN`` on first use (its
import costs a CPU run 1.3 s for nothing); ``VARLEN`` here reads that one (tests replace the module attributes,
and ``rule.device_facts``).
"""
from flexsp.runtime.kernels.dispatch import attend
from flexsp.runtime.kernels.features import PLAIN, Features
from flexsp.runtime.kernels.layout import AttentionError, Bounds, LseSpec
from flexsp.runtime.kernels.lse import attend_lse, lse_backward, lse_forward, merge_partials
from flexsp.runtime.kernels.padding import Rows
from flexsp.runtime.kernels.reference import block_mask, reference
from flexsp.runtime.kernels.sinks import with_sinks
from flexsp.runtime.kernels.rule import (BACKENDS, DeviceFacts, LengthMix, choose, device_facts, flash_available,
                                         resolve_backend, varlen_available)
from flexsp.runtime.kernels import varlen as _varlen
from flexsp.runtime.kernels.varlen import VarlenAPI


def __getattr__(name: str):
    if name == "VARLEN":
        return _varlen.api()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Features", "PLAIN", "with_sinks", "attend", "attend_lse", "lse_forward", "lse_backward", "merge_partials", "reference", "block_mask",
           "resolve_backend", "choose", "device_facts", "DeviceFacts", "LengthMix", "BACKENDS", "AttentionError",
           "Bounds", "LseSpec", "Rows", "flash_available", "varlen_available", "VARLEN", "VarlenAPI"]
