"""Several ranks on one GPU: a planned step at SP degrees 2 and 4 run by 4 processes that share the one GPU
over gloo with CUDA tensors, against the one-process result (``scripts/gpu_check.sh``'s ``ranks`` step).

NCCL cannot put two ranks on one GPU, so a one-GPU box has never run degree > 1 on the CUDA kernels; gloo
can. The plan: a micro-batch at degree 2 (two groups) beside one at degree 1 with rank 3 idle (the
executor's one-token dummy), then one at degree 4 - Ulysses only. Every group's token count is off its
degree's multiple, so every pack pads, and each rank poisons its allocator (``runtime.poison``) before
the step, so a padding row a kernel leaves unwritten would reach the weight gradients as NaN.

What gloo carries for CUDA tensors (GPU run 1, H200, torch 2.11): all_to_all_single (even and uneven),
all_reduce (fp32, bf16), broadcast, all_gather(_into_tensor), reduce_scatter_tensor, sub-group
all-to-all - everything the Ulysses step uses. Not send/recv (``pair.cc writev: Bad address``), which the
ring's point-to-point exchange needs: the ring is not run here (``RING_NOT_CARRIED``).

    python scripts/shared_gpu_ranks.py --output ranks.json            # on the GPU box (bf16, cuda:0)
    python scripts/shared_gpu_ranks.py --device cpu --output r.json   # the CPU rehearsal (fp32, gloo)

Exit code 0 when every rank's gradients match the one-process reference within the dtype's tolerance.
Imports torch and flexsp only (no pytest, no hypothesis).
"""
from __future__ import annotations

import argparse
import json
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORLD = 4
LENGTHS = (300, 77, 513, 129, 1000, 45, 250, 90, 611, 33)   # no group's tokens a multiple of its degree
CPU_LENGTHS = (75, 19, 129, 33, 250, 11, 63, 22, 153, 9)     # the rehearsal's (a quarter; still padded)
RING_NOT_CARRIED = ("ring attention not run: its point-to-point exchange (send/recv) is not carried by gloo "
                    "for CUDA tensors (GPU run 1: pair.cc writev 'Bad address')")
TOLERANCE = {"bf16": 4e-2, "fp32": 1e-4}     # max |g - reference| / max |reference|


def plan():
    from flexsp.plan.types import Group, MicroBatch, Plan

    def mb(*groups):
        return MicroBatch(tuple(Group(ranks=tuple(r), seq_ids=tuple(s)) for r, s in groups))
    return Plan(num_gpus=WORLD, predicted_time=0.0, micro_batches=(
        mb(((0, 1), (0, 1)), ((2, 3), (2,))),            # degree 2, two groups
        mb(((0, 1), (3, 4)), ((2,), (5,))),              # degree 2 and 1; rank 3 idle: the one-token dummy
        mb(((0, 1, 2, 3), (6, 7, 8, 9))),                # degree 4
    ))


def spec(device: str):
    from flexsp.plan.specs import ModelSpec
    if device == "cuda":   # GQA, head dim 128 (cuDNN's and Flash's), a vocabulary the loss chunks
        return ModelSpec(vocab=4096, hidden=512, layers=2, heads=8, kv_heads=2, ffn=1024, name="ranks-check")
    return ModelSpec(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, name="ranks-check-cpu")


def lengths(device: str) -> tuple[int, ...]:
    return LENGTHS if device == "cuda" else CPU_LENGTHS


def batch(vocab: int, device):
    import torch
    gen = torch.Generator().manual_seed(3)
    sizes = lengths(device.type)
    ids = torch.randint(1, vocab, (sum(sizes),), generator=gen)
    return [s.to(device) for s in ids.split(sizes)]


def model(device, dtype, cfg):
    import torch

    from flexsp.runtime.models.tiny import TinyLM
    torch.manual_seed(21)
    return TinyLM(cfg).to(device=device, dtype=dtype)


def flat_grads(m):
    import torch
    return torch.cat([p.grad.reshape(-1) for p in m.parameters()]).float()


def worker(rank: int, args, port: int, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        from flexsp.runtime.kernels import ran
        from flexsp.runtime.poison import poison_allocator
        from flexsp.runtime.pool import GroupPool
        from flexsp.runtime.step import StepExecutor

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=args.timeout))
        device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
        cfg = spec(args.device)
        m = model(device, dtype, cfg)
        executor = StepExecutor(m, torch.optim.SGD(m.parameters(), lr=0.0), GroupPool(splits=[(2, 2)]))
        poison_allocator(device, 256 * 2**20)
        result, kernels = ran.kernels_in(lambda: executor.run_plan(plan(), batch(cfg.vocab, device)))
        # the gradients go by value (numpy): a tensor would go as a shared-memory handle that the parent can
        # no longer open once this process has exited, and the result would be lost
        out = {"rank": rank, "loss": result.loss, "degrees": list(result.degrees), "kernels": kernels,
               "grads": flat_grads(m).cpu().numpy()}
        executor.close()
        dist.destroy_process_group()
        queue.put(out)
    except BaseException:
        queue.put({"rank": rank, "error": traceback.format_exc()})


def reference(args):
    """The one-process result: the same model, each sequence's summed loss over the batch's label tokens."""
    import torch
    import torch.nn.functional as F

    from flexsp.runtime.shard import loss_tokens
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = spec(args.device)
    m = model(device, dtype, cfg)
    loss = sum(F.cross_entropy(m(s)[:-1].float(), s[1:], reduction="sum") for s in batch(cfg.vocab, device))
    (loss / loss_tokens(lengths(args.device))).backward()
    return flat_grads(m).cpu()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--output", type=Path, default=None, help="JSON results (default: print only)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the ranks (then they are ended)")
    args = parser.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the rehearsal")
        return 2
    start = time.monotonic()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    outs = {}
    deadline = time.monotonic() + args.timeout
    while len(outs) < WORLD and time.monotonic() < deadline:
        try:
            item = queue.get(timeout=1.0)
        except queue_module.Empty:
            # a rank that died, or every rank gone with results missing: nothing more will come
            if queue.empty() and (any(p.exitcode not in (None, 0) for p in procs)
                                  or all(p.exitcode is not None for p in procs)):
                break
            continue
        outs[item["rank"]] = item
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    errors = {r: o["error"].strip().splitlines()[-1] for r, o in outs.items() if "error" in o}
    missing = [r for r in range(WORLD) if r not in outs]
    report = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU", "torch": torch.__version__,
              "world": WORLD, "backend": "gloo", "lengths": list(lengths(args.device)), "ring": RING_NOT_CARRIED,
              "tolerance": TOLERANCE["bf16" if args.device == "cuda" else "fp32"]}
    ok = not errors and not missing
    if ok:
        want = reference(args)
        grads = [torch.from_numpy(outs[r]["grads"]) for r in range(WORLD)]
        errs = [float((g - want).abs().max() / want.abs().max()) for g in grads]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        report.update(degrees=outs[0]["degrees"], kernels=outs[0]["kernels"], losses=[outs[r]["loss"] for r in range(WORLD)],
                      max_relative_error=max(errs), finite=finite)
        ok = finite and max(errs) <= report["tolerance"]
    else:
        report.update(errors={str(r): e for r, e in errors.items()}, missing=missing,
                      timed_out=time.monotonic() >= deadline)
        for r, o in outs.items():
            if "error" in o:
                print(f"rank {r} failed:\n{o['error']}")
    report["pass"], report["seconds"] = ok, round(time.monotonic() - start, 1)
    if ok:
        from flexsp.runtime.kernels import ran
        line = (f"{WORLD} ranks on one {'GPU' if args.device == 'cuda' else 'CPU'} over gloo, degrees "
                f"{report['degrees']}: gradients vs one process {report['max_relative_error']:.2e} of the largest "
                f"(tolerance {report['tolerance']:.0e}); attention {ran.describe(report['kernels'])}; {RING_NOT_CARRIED}")
    else:
        line = (f"FAILED: ranks {missing} did not finish within --timeout {args.timeout:.0f} s" if report["timed_out"]
                else f"FAILED: {errors}" if errors else f"FAILED: ranks {missing} ended without sending a result")
    report["summary"] = line
    print(("pass: " if ok else "") + line)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({k: v for k, v in report.items()}, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
