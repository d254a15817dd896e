"""Read what the model really does: one packed forward under FlexSP's attention against the native model.

Config flags and module names say what a family should do; ``probe`` checks what it does. Before
any collective (``prepare_model`` calls it), it runs two short sequences packed into one row through
the adapter at SP degree 1 - the path every SP group takes, minus the all-to-alls - and each sequence
alone through the unmodified model, and compares the logits. A model that mixes tokens some other way
(ALiBi biases, convolutions, recurrent or linear-attention layers, attention calls that bypass the
registry), asks the attention for something FlexSP refuses (dropout in training mode), or fails on
a packed row is refused here, naming what happened, instead of failing or drifting mid-step.
"""
from __future__ import annotations

import torch

from flexsp.hf.features import UnsupportedModelError
from flexsp.runtime.sp.context import AttentionContext

LENGTHS = (6, 4)
# Relative logit tolerance per parameter dtype: far above rounding, far below any different maths.
# fp64: transformers models compute some steps in float32 even in an fp64 model (eager attention's softmax,
# Llama 4's router scores, Granite-SWA's sink scale), so the native reference carries float32 rounding
# (~1e-7 relative); a different mask or mixing is off by far more.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def probe(adapter) -> None:
    """Raise ``UnsupportedModelError`` unless ``adapter`` reproduces its model on a packed row.

    Skipped for a model on the meta device (nothing to run). Restores the model's training mode.
    """
    model, name = adapter.model, adapter.name
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return
    vocab = int(model.get_output_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, max(2, min(vocab, 1000)), (n,), generator=gen).to(param.device) for n in LENGTHS]
    ids = torch.cat(seqs)
    pos = torch.cat([torch.arange(n, device=param.device) for n in LENGTHS])
    ctx = AttentionContext.packed((0, *torch.tensor(LENGTHS).cumsum(0).tolist()), param.device, backend="auto")
    was_training = model.training
    try:
        with torch.no_grad():
            try:
                adapter.hidden_states(ids, pos, ctx)   # in the caller's mode: what training will ask for
                model.eval()
                ours = adapter(ids, pos, ctx).float()
            except UnsupportedModelError:
                raise
            except Exception as exc:
                first = str(exc).splitlines()[0][:200] if str(exc) else ""
                raise UnsupportedModelError(f"{name}: fails on a packed row under FlexSP's attention at SP degree 1 "
                                            f"({type(exc).__name__}: {first})") from None
            native = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs]).float()
    finally:
        model.train(was_training)
    scale = float(native.abs().max()) or 1.0
    error = float((ours - native).abs().max()) / scale
    tol = TOLERANCE.get(param.dtype, 1e-4)
    if not error <= tol:
        raise UnsupportedModelError(
            f"{name}: its logits on two packed sequences under FlexSP's attention differ from the native model's "
            f"by {error:.1e} (relative; tolerance {tol:g}): it mixes tokens in a way the packed causal attention "
            f"does not reproduce (position biases such as ALiBi, convolutions, recurrent or linear-attention "
            f"layers, or packing across sequence boundaries)")
