"""FlexSP's attention at SP degree 1 against the model's native attention, same HF model, same packed batch.

    python experiments/hf_attention_benchmark.py --model llama --lengths 8K,4K,2K,2K,1K,1K --attn sdpa
    python experiments/hf_attention_benchmark.py --model CONFIG_DIR --attn flash_attention_2   # on a GPU
    python experiments/hf_attention_benchmark.py --quick                                     # CI: tiny, CPU

Both sides run one forward + backward of the same random-init model on the same packed row
(position ids restarted per sequence): "native" is the unmodified transformers forward (its own
packed-sequence masking; for sdpa/eager that is a [tokens, tokens] mask), "flexsp" is
``prepare_model(model).shard_loss`` (FlexSP's varlen attention under the same registry key, chunked
LM-head loss). Reports the loss of each (they must agree), milliseconds per step, tokens/s and, on
CUDA, peak memory. The device and load are printed with the numbers: CPU figures say nothing of GPUs.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flexsp.hf import from_config, load_config, prepare_model  # noqa: E402
from flexsp.runtime import AttentionContext, pack  # noqa: E402


def _count(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * 1024) if text.endswith("K") else int(text)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int, warmup: int) -> tuple[float, float, int]:
    """(median seconds, loss, peak bytes above start on CUDA else 0) of ``fn() -> loss`` incl. backward."""
    for _ in range(warmup):
        fn()
    times, loss, peak = [], 0.0, 0
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        _sync(device)
        start = time.perf_counter()
        loss = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
    return sorted(times)[len(times) // 2], loss, peak


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}[
        args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")]
    lengths = [_count(t) for t in args.lengths.split(",")]
    native = from_config(load_config(args.model), dtype=dtype, device=device, attn_implementation=args.attn,
                         seed=0, max_seqlen=max(lengths)).model
    flexsp = prepare_model(copy.deepcopy(native), max_seqlen=max(lengths))
    vocab = native.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    packed = pack([torch.randint(1, vocab, (n,), generator=gen) for n in lengths], 1)
    ids, pos, labels = (t.to(device) for t in (packed.input_ids, packed.position_ids, packed.labels))
    ctx = AttentionContext(cu_seqlens=packed.cu_seqlens, max_seqlen=packed.max_seqlen, backend=args.backend)
    denominator = int((packed.labels != -100).sum())

    def native_step() -> float:
        native.zero_grad(set_to_none=True)
        logits = native(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), labels, reduction="sum") / denominator
        loss.backward()
        return float(loss.detach())

    def flexsp_step() -> float:
        flexsp.zero_grad(set_to_none=True)
        loss = flexsp.shard_loss(ids, pos, labels, ctx) / denominator
        loss.backward()
        return float(loss.detach())

    rows = {}
    for name, fn in (("native", native_step), ("flexsp", flexsp_step)):
        seconds, loss, peak = _time(fn, device, args.repeats, args.warmup)
        rows[name] = {"loss": loss, "ms": seconds * 1e3, "tokens_per_s": packed.real_tokens / seconds,
                      "peak_gib": peak / 2**30 if device.type == "cuda" else None}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"model": native.__class__.__name__, "attn": args.attn, "backend": args.backend, "device": where,
            "dtype": str(dtype).replace("torch.", ""), "lengths": lengths, "tokens": packed.real_tokens,
            "rows": rows, "loss_rel_diff": abs(rows["flexsp"]["loss"] - rows["native"]["loss"]) / abs(rows["native"]["loss"]),
            "quick": args.quick}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama", help="config directory or built-in tiny arch")
    p.add_argument("--attn", default="sdpa", help="attn_implementation key of both runs")
    p.add_argument("--backend", default="auto", help="FlexSP's local kernel: auto (flash on GPU if installed), sdpa")
    p.add_argument("--lengths", default="2K,1K,1K,512,512,256,256,128")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32, fp64")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny lengths, one repeat (CI)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.lengths, args.repeats, args.warmup, args.device = "96,64,33,17", 1, 0, "cpu"
    result = run(args)
    print(f"{result['model']} ({result['attn']}), {result['tokens']} tokens in {len(result['lengths'])} packed "
          f"sequences, {result['dtype']} on {result['device']}{' (quick mode)' if args.quick else ''}")
    print(f"| attention | loss | ms / fwd+bwd | tokens/s | peak GiB |\n|---|---|---|---|---|")
    for name, r in result["rows"].items():
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {name} | {r['loss']:.6f} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {peak} |")
    print(f"loss relative difference {result['loss_rel_diff']:.2e}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
