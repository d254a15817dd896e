"""Which kernel computes a layer's features: the rule's choice (``rule.py``), kept when that kernel computes
the window, softcap and sinks in its own call, else a documented fallback - never a silently different one.

``rule.choose`` picks a kernel for speed on a plain causal layer; this module then reads what the
installed APIs take (``flash.FLASH``'s signature, ``varlen.VARLEN``'s) and answers ``(kernel, lse)``:
``lse`` True means the layer runs as ``attend_lse`` on that kernel and ``sinks.with_sinks`` corrects the
output (``out * sigmoid(lse - sink)``). Chunked attention never appears here: ``attend`` cuts the bounds
at every chunk, which every kernel computes.

``attend`` (same tokens, positions from the bounds):

=================  ===========================================================================
rule's kernel      with a window / softcap / sinks
=================  ===========================================================================
``reference``      itself (it computes everything)
``flash``          itself where its signature takes every feature (``learnable_sink`` for sinks);
                   sinks without it: ``varlen`` lse form + correction if varlen takes the rest, else ``sdpa``
``varlen``         itself for a window (``window_size``, torch >= 2.12; before: ``flash`` if it takes one, else
                   ``sdpa``); sinks: its lse form + correction (the backward op must take ``window_size``
                   too); softcap: ``flash`` if it takes it, else ``sdpa``
``varlen_cudnn``   as ``varlen`` (cuDNN's varlen branch is not known to honour a window)
``sdpa``           the per-sequence explicit lse form (``sdpa.each_forward``) + correction for sinks:
``sdpa_each``      SDPA's fused kernels take no window mask, softcap or sink
=================  ===========================================================================

The log-sum-exp form (``attend_lse``, the ring) runs ``varlen`` only for a window with bottom-right
positions (the backward op taking ``window_size``), never for a softcap, a chunk or explicit positions
(the ring's zigzag blocks): those run the per-sequence ``sdpa`` form, on any device, in query-row tiles
of bounded memory (``sdpa.row_tiles``), each against the band of keys a window or chunk lets its rows see
(``sdpa.key_band``, from host positions): about ``rows x window`` work, not ``rows x keys``.
"""
from __future__ import annotations

from flexsp.runtime.kernels import flash, varlen
from flexsp.runtime.kernels.features import Features

_VARLEN = ("varlen", "varlen_cudnn")


def attend_kernel(kernel: str, features: Features, sinks: bool) -> tuple[str, bool]:
    """``(kernel, lse)`` for ``attend`` given the rule's ``kernel`` (see the module docstring's table)."""
    window, softcap = features.window is not None, features.softcap is not None
    if kernel == "reference" or not (window or softcap or sinks):
        return kernel, False
    if kernel != "flash" and kernel not in _VARLEN:
        return "sdpa", True
    api, vl = flash.FLASH, varlen.api()
    varlen_lse = vl is not None and not softcap and (not window or vl.takes_window(backward=True))
    if kernel == "flash":
        if flash.supports(api, window, softcap, sinks):
            return "flash", False
        if sinks and varlen_lse:
            return "varlen", True
        return "sdpa", True
    if softcap:                        # a varlen kernel from here on
        return ("flash", False) if flash.supports(api, window, softcap, sinks) else ("sdpa", True)
    if sinks:
        return ("varlen", True) if varlen_lse else ("sdpa", True)
    if vl is not None and vl.takes_window(backward=False):
        return "varlen", False
    return ("flash", False) if flash.supports(api, window, False, False) else ("sdpa", True)


def lse_kernel(kernel: str, features: Features, explicit_positions: bool) -> str:
    """The log-sum-exp kernel for a layer with ``features``, given the rule's lse choice ``kernel``."""
    if kernel not in _VARLEN or features.plain:
        return kernel
    vl = varlen.api()
    if features.window is not None and features.chunk is None and features.softcap is None \
            and not explicit_positions and vl is not None and vl.takes_window(backward=True):
        return "varlen"
    return "sdpa"
