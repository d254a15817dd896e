"""Train a Hugging Face transformers causal LM with FlexSP: each step gets its own mix of SP groups.

    torchrun --nproc_per_node=4 examples/train_hf.py --model qwen3 --steps 20      # built-in tiny Qwen3
    torchrun --nproc_per_node=8 examples/train_hf.py --model path/to/config_dir \\
        --data corpus.jsonl --tokenizer path/to/tokenizer_dir --cost h100x8.json --max-len 32768
    python examples/train_hf.py --steps 3                                           # a world of one

The model is random-initialised from its config (a directory holding config.json, or a built-in
tiny llama/qwen2/qwen3/mistral/gemma/phi3) and wrapped by ``flexsp.hf.prepare_model``: its own
attention key in transformers' registry now runs FlexSP's Ulysses attention over each step's SP
groups. Text comes from local jsonl or parquet files through ``datasets`` (``--data``; without it,
this repository's own markdown and Python files, one paragraph per row), tokenised with a local
tokenizer (``--tokenizer``) or bytes (ids 0..255). ``flexsp.data.FlexSPLoader`` forms global
batches, plans them in the background and hands each rank its packed shards. Gradients are summed
over all ranks (FSDP2-sharded states), so the update equals training the whole global batch on one device. Model,
optimizer, loader and RNG state are checkpointed by ``flexsp.checkpoint.Checkpointer`` under ``--out``/checkpoints
every ``--checkpoint-every`` steps (and on SIGTERM); ``--resume`` continues from the newest good one.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

try:
    import flexsp
except ModuleNotFoundError:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import flexsp
import flexsp.runtime as runtime
from flexsp import PlanConfig
from flexsp.checkpoint import Checkpointer
from flexsp.data import FlexSPLoader, LoaderConfig
from flexsp.hf import from_config, load_config
from flexsp.plan.specs import spec_from_hf_config
from flexsp.telemetry import Telemetry

# -----------------------------------------------------------------------------------------------
# config
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default="llama", help="config directory, or a built-in tiny arch (default llama)")
parser.add_argument("--attn", default="sdpa", help="attn_implementation key FlexSP wraps (sdpa, eager, flash_attention_2)")
parser.add_argument("--data", nargs="*", default=None, help="local .jsonl/.json/.parquet files (default: this repo's text)")
parser.add_argument("--text-field", default="text")
parser.add_argument("--tokenizer", default=None, help="local tokenizer directory (default: bytes, ids 0..255)")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=32, help="sequences per global batch")
parser.add_argument("--max-len", type=int, default=1024, help="sequences are cut to this many tokens")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--cost", type=Path, default=None, help="cost model JSON from `flexsp profile` (default: a made-up one)")
parser.add_argument("--token-capacity", type=int, default=512, help="tokens per GPU for the made-up cost model")
parser.add_argument("--strategy", default="flexsp")
parser.add_argument("--time-limit", type=float, default=1.0, help="planner seconds per step")
parser.add_argument("--log-every", type=int, default=0, help="also print a line every N steps (0: the bar only)")
parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between checkpoints (0: only on SIGTERM)")
parser.add_argument("--out", type=Path, default=Path("runs/train_hf"), help="run directory (runs/ is git-ignored)")
parser.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in --out")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--run-dir", type=Path, default=None,
                    help="record every step there (flexsp.telemetry); read it with `flexsp report DIR`")
parser.add_argument("--refit", action="store_true", help="refit the cost model from measured group times (with --run-dir)")
parser.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s for MFU (default: known GPUs)")
args = parser.parse_args()

# -----------------------------------------------------------------------------------------------
# distributed setup: torchrun sets RANK/WORLD_SIZE; plain python is a world of one
device = runtime.init_distributed()   # NCCL with device_id on GPUs (eager), gloo on CPUs
rank, world = dist.get_rank(), dist.get_world_size()
use_cuda = device.type == "cuda"
master = rank == 0


def log(*parts):
    if master:
        tqdm.write(" ".join(str(p) for p in parts))


pool = runtime.GroupPool()   # every SP group a plan may use, created once (collective)

# -----------------------------------------------------------------------------------------------
# data: local files -> datasets.Dataset -> token ids
import datasets  # noqa: E402

datasets.disable_progress_bars()
if args.data:
    files = [str(p) for p in args.data]
    kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(Path(files[0]).suffix)
    if kind is None:
        raise SystemExit(f"--data: expected .jsonl, .json or .parquet files, got {files[0]}")
else:   # this repository's own prose and code, one paragraph per row (rank 0 writes, everyone reads)
    kind, files = "json", [str(Path(tempfile.gettempdir()) / f"flexsp_train_hf_{os.environ.get('MASTER_PORT', 'local')}.jsonl")]
    if master:
        root = Path(__file__).resolve().parents[1]
        with open(files[0], "w") as f:
            for path in sorted([*root.glob("*.md"), *root.glob("flexsp/**/*.py"), *root.glob("solver/*.py")]):
                for para in path.read_text(errors="replace").split("\n\n"):
                    if len(para.strip()) > 20:
                        f.write(json.dumps({args.text_field: para}) + "\n")
    dist.barrier()
raw = datasets.load_dataset(kind, data_files=files, split="train")

config = load_config(args.model)
if args.tokenizer:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    encode = lambda texts: tokenizer(texts, add_special_tokens=True)["input_ids"]  # noqa: E731
    vocab = len(tokenizer)
else:
    encode = lambda texts: [list(t.encode("utf-8")) for t in texts]  # noqa: E731
    vocab = 256
if config.vocab_size < vocab:
    raise SystemExit(f"the model's vocab_size {config.vocab_size} is smaller than the tokenizer's {vocab}")
dataset = raw.map(lambda rows: {"input_ids": [ids[:args.max_len] for ids in encode(rows[args.text_field])]},
                  batched=True, remove_columns=raw.column_names, load_from_cache_file=False)
dataset = dataset.filter(lambda row: len(row["input_ids"]) >= 2)
lengths = [len(ids) for ids in dataset["input_ids"]]
log(f"data: {len(dataset)} sequences from {', '.join(Path(f).name for f in files)}, lengths {min(lengths)}..{max(lengths)} "
    f"tokens (mean {sum(lengths) / len(lengths):.0f}), {'tokenizer ' + args.tokenizer if args.tokenizer else 'bytes'}")

# -----------------------------------------------------------------------------------------------
# model: the same seed on every rank gives the same replica
dtype = torch.bfloat16 if use_cuda else torch.float32
model = from_config(config, dtype=dtype, device=device, attn_implementation=args.attn, seed=args.seed,
                    max_seqlen=args.max_len)
heads, kv_heads = model.sp_heads()   # SP degrees must divide the heads: at most heads & -heads
name = model.name
# Sharded model states: FSDP2 fully_shard per decoder layer, then the root; bf16 compute with fp32
# master weights and reduction on GPUs, fp32 on CPUs.
model = runtime.shard_model(model, param_dtype=torch.bfloat16 if use_cuda else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
log(f"model: {name}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, heads {heads}/{kv_heads}, "
    f"{str(dtype).replace('torch.', '')}, attention key {args.attn!r} wrapped by FlexSP, "
    f"states sharded (FSDP2); world {world}, device {device}")

# -----------------------------------------------------------------------------------------------
# the planner's view of this machine
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
cluster = flexsp.Cluster(num_gpus=world, gpus_per_node=1 << (local_world - 1).bit_length())
if args.cost is not None:
    cost = flexsp.CostModel.load(args.cost)
else:   # made-up numbers of the right shape; profile yours with `flexsp profile --hf-config DIR`
    cost = flexsp.CostModel(alpha1=2e-9, alpha2=2e-6, beta1=1e-4,
                            comm_bytes_per_token=4 * 2 * config.num_hidden_layers * config.hidden_size * 4,
                            alltoall_bandwidth={d: 2e9 / d for d in cluster.degrees if d > 1},
                            token_capacity=args.token_capacity)
if args.max_len > cost.token_capacity * world:
    raise SystemExit(f"--max-len {args.max_len} does not fit the whole world ({world} x {cost.token_capacity} tokens)")
loader = FlexSPLoader(dataset, cost, cluster, pool=pool, device=device, lengths=lengths,
                      vocab_size=config.vocab_size,
                      config=LoaderConfig(batch_size=args.batch_size, seed=args.seed,
                                          plan=PlanConfig(strategy=args.strategy, time_limit=args.time_limit,
                                                          max_degree=heads & -heads)))
# per-step records measured against the plan (optional); with --refit the loader's planner gets refitted cost models
telemetry = None if args.run_dir is None else Telemetry(
    args.run_dir, cost, spec=spec_from_hf_config(config), device=device, peak_flops=args.peak_flops,
    log_every=args.log_every or 10, refit=args.refit, on_refit=loader.set_cost, log=log)
executor = runtime.StepExecutor(model, optimizer, pool, cost=cost,   # the one planned step path
                                probe=None if telemetry is None else telemetry.probe)
# Model, optimizer, loader position and every rank's RNG, atomically, every --checkpoint-every steps and on SIGTERM.
ckpt = Checkpointer(args.out / "checkpoints", model, optimizer, loader=loader, every=args.checkpoint_every)
if args.resume:
    restored = ckpt.restore()
    log(f"resume: {'from step ' + str(restored) if restored else 'no checkpoint in ' + str(args.out) + ', starting fresh'}")


def describe(plan):
    """e.g. ``[4] [2 1 1]``: the group degrees of each micro-batch."""
    return " ".join("[" + " ".join(str(g.degree) for g in mb.groups) + "]" for mb in plan.micro_batches)


# -----------------------------------------------------------------------------------------------
# training loop
bar = tqdm(total=args.steps, disable=not master, unit="step", dynamic_ncols=True)
step, tokens_seen, start = ckpt.step, 0, time.perf_counter()
bar.update(step)
stop = False
while step < args.steps and not stop:
    for batch in loader:   # one epoch; the next global batches are planned meanwhile
        t0 = time.perf_counter()
        loss = executor.step(batch).loss
        seconds = time.perf_counter() - t0
        step += 1
        tokens_seen += batch.num_tokens
        bar.set_postfix_str(f"loss {loss:.3f} | {batch.num_tokens / seconds:,.0f} tok/s | groups {describe(batch.plan)}")
        bar.update()
        if args.log_every and step % args.log_every == 0:
            log(f"step {step:4d} | loss {loss:.4f} | {batch.num_tokens:6d} tokens in {len(batch.indices)} seqs "
                f"(max {max(batch.lengths)}) | {batch.num_tokens / seconds:8,.0f} tok/s | groups {describe(batch.plan)}")
        before = ckpt.last_saved
        stop = ckpt.step_done()   # saves every N steps; True after a SIGTERM on any rank (saved: stop everywhere)
        if ckpt.last_saved != before:
            log(f"checkpoint: {ckpt.last_saved}")
        if step == args.steps or stop:
            break
bar.close()
elapsed = time.perf_counter() - start
log(f"done: {step} steps, {tokens_seen:,} tokens in {elapsed:.1f}s ({tokens_seen / elapsed:,.0f} tok/s overall), "
    f"final loss {loss:.4f}")
ckpt.close()
loader.close()
if telemetry is not None:
    telemetry.close()
    log(f"telemetry: {telemetry.records} step records in {args.run_dir}; `flexsp report {args.run_dir}` summarises them")
dist.destroy_process_group()
