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
            noise = native_noise(model, seqs, native)
    finally:
        model.train(was_training)
    scale = float(native.abs().max()) or 1.0
    error = float((ours - native).abs().max()) / scale
    tol = max(TOLERANCE.get(param.dtype, 1e-4), min(NOISE_FACTOR * noise, NOISE_CAP))
    if not error <= tol and error <= ROUNDING:
        raise UnsupportedModelError(
            f"{name}: its logits on two packed sequences under FlexSP's attention differ from the native model's "
            f"by {error:.1e} (relative; tolerance {tol:g}), at fp32 rounding although the weights are "
            f"{str(param.dtype).removeprefix('torch.')}: likely an fp32 cast inside the model (eager attention's "
            f"softmax, a router or rotary computed in fp32) that rounds a packed row differently; FlexSP does "
            f"not claim it exact")
    if not error <= tol:
        raise UnsupportedModelError(
            f"{name}: its logits on two packed sequences under FlexSP's attention differ from the native model's "
            f"by {error:.1e} (relative; tolerance {tol:g}): it mixes tokens in a way the packed causal attention "
            f"does not reproduce (position biases such as ALiBi, convolutions, recurrent or linear-attention "
            f"layers, or packing across sequence boundaries)")


# The native model's own rounding noise widens the tolerance (never beyond NOISE_CAP): a model that casts to fp32
# inside (a router's softmax, an fp32 recurrence, eager attention's fp32 softmax) disagrees with itself across
# batch shapes at fp32 rounding even with fp64 weights, and FlexSP's packed row is one more batch shape.
NOISE_FACTOR, NOISE_CAP = 10.0, 1e-5
ROUNDING = 1e-6   # a larger difference is different maths, not rounding


def native_noise(model, seqs, native: torch.Tensor) -> float:
    """How far the native model's logits move when the same sequences run as one right-padded batch with
    its attention mask instead of one at a time (relative, max-norm); 0.0 where that batch fails."""
    width = max(int(s.numel()) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=native.device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :s.numel()], mask[i, :s.numel()] = s, 1
    try:
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    except Exception:
        return 0.0
    batched = torch.cat([logits[i, :s.numel()] for i, s in enumerate(seqs)]).float()
    return float((batched - native).abs().max()) / (float(native.abs().max()) or 1.0)
