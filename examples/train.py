"""Train a tiny LLaMA-style model with FlexSP: every step gets its own mix of SP groups.

    torchrun --nproc_per_node=4 examples/train.py      # 4 processes (NCCL on GPUs, gloo on CPU)
    python examples/train.py                           # a world of one

A dataset of variable-length token sequences goes through ``flexsp.data.FlexSPLoader``: it forms
global batches, plans each in a background process (rank 0 plans, every rank gets the same plan),
and hands each rank the packed shards of the micro-batches it takes part in. The model's states are
sharded with FSDP2 (``shard_model``: bf16 compute, fp32 master weights and gradient reduction);
``StepExecutor.step`` checks the step on every rank, runs each shard with Ulysses attention over the
step's SP groups (long sequences in big groups, short ones alone), reduce-scatters gradients during
backward and takes one optimizer step; the update equals training the whole batch on one device.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

try:
    import flexsp
except ModuleNotFoundError:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import flexsp
from flexsp import PlanConfig
from flexsp.cli import OneLineParser, whole_number
from flexsp.data import FlexSPLoader, LoaderConfig
from flexsp.plan.specs import ModelSpec
from flexsp.runtime import GroupPool, StepExecutor, TinyLM, TrainConfig, init_distributed, shard_model
from flexsp.telemetry import Telemetry

# -----------------------------------------------------------------------------------------------
# config
parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=whole_number(1), default=10, help="optimizer steps to take (>= 1)")
parser.add_argument("--batch-size", type=whole_number(1), default=24, help="sequences per global batch")
parser.add_argument("--max-len", type=whole_number(1), default=600,
                    help="longest sequence, in tokens (capped at what the largest SP group of this world holds)")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--strategy", default="flexsp", help="flexsp, batchada, static, greedy")
parser.add_argument("--time-limit", type=float, default=2.0, help="planner seconds per step")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--dataset-size", type=whole_number(1), default=2000, help="sequences in the synthetic dataset")
parser.add_argument("--lookahead", type=whole_number(0), default=2, help="global batches planned ahead in the background")
parser.add_argument("--sharding", default="full", choices=("full", "grad_optim", "none"),
                    help="model-state sharding (the cost model's capacity assumes the same)")
parser.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                    help="compute dtype (auto: bf16 on GPUs, fp32 on CPUs); master weights stay fp32")
parser.add_argument("--run-dir", type=Path, default=None,
                    help="record every step there (flexsp.telemetry: JSON lines, a log line every --log-every steps); "
                         "read it with `flexsp report DIR`")
parser.add_argument("--log-every", type=whole_number(0), default=5, help="telemetry log line every N steps (with --run-dir)")
parser.add_argument("--refit", action="store_true", help="refit the cost model from measured group times (with --run-dir)")
parser.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s for MFU (default: known GPUs)")
args = parser.parse_args()
model_config = ModelSpec(vocab=256, hidden=64, layers=2, heads=8, kv_heads=2, ffn=128, tie_embeddings=True)
# every planning setting in one object, every runtime setting in another: the sharding the planner's
# capacity assumes and the sharding FSDP2 runs are the same value
try: plan_config = PlanConfig(strategy=args.strategy, time_limit=args.time_limit, sharding=args.sharding)  # noqa: E701
except flexsp.FlexSPError as exc: sys.exit(f"{parser.prog}: error: {exc}")   # one line, before any setup  # noqa: E701

# -----------------------------------------------------------------------------------------------
# distributed setup: torchrun sets RANK/WORLD_SIZE; plain python is a world of one. On GPUs the
# world communicator is created now (init_process_group(device_id=...)), not inside the first step.
device = init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
use_cuda = device.type == "cuda"
master = rank == 0


def log(*parts):
    if master:
        print(*parts, flush=True)


# Every SP group a plan can use, created once (collective), warmed up, and reused by every step.
pool = GroupPool()
log(f"world {world} ({dist.get_backend()}), device {device}: {pool.stats.count} SP groups created and warmed up in "
    f"{pool.stats.seconds:.3f}s, {pool.stats.per_rank} communicators on this rank")

# -----------------------------------------------------------------------------------------------
# model: the same seed on every rank, then FSDP2 shards its states (bf16 compute, fp32 master weights)
torch.manual_seed(args.seed)
model = TinyLM(model_config).to(device)
compute = torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and use_cuda) else None
train_config = TrainConfig(sharding=plan_config.sharding, param_dtype=compute)
shard_model(model, train_config)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)   # after sharding: fp32 shards
log(f"model: {sum(p.numel() for p in model.parameters()) / 1e3:.1f}K parameters, {model_config}, "
    f"sharding {train_config.sharding}, compute {compute or 'fp32'}")

# -----------------------------------------------------------------------------------------------
# the planner's view of this machine: made-up numbers that suit a tiny model
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
cluster = flexsp.Cluster(num_gpus=world, gpus_per_node=1 << (local_world - 1).bit_length())
token_capacity = 256   # tokens one GPU may hold: a 600-token sequence needs a group of 4
cost = flexsp.CostModel(
    alpha1=2e-9,                                           # s per token^2 (attention)
    alpha2=2e-6,                                           # s per token (everything else)
    beta1=1e-4,                                            # s per group per micro-batch
    comm_bytes_per_token=4 * 2 * model_config.layers * model_config.hidden * 4,
    alltoall_bandwidth={d: 2e9 / d for d in cluster.degrees if d > 1},
    token_capacity=token_capacity,
    meta={"sharding": plan_config.sharding},   # the capacity assumes the sharding the runtime runs
)
# the longest sequence must fit the largest SP group this world runs: at 3 ranks that is a group of 2
# (degrees are the pool's, powers of two by default), not all 3 ranks
max_len = min(args.max_len, cost.group_capacity(max(pool.degrees)))


class SyntheticTokens(torch.utils.data.Dataset):
    """A map-style dataset of long-tailed, variable-length token lists (any tokenized dataset works:
    lists, tensors, or dicts with ``input_ids`` such as a Hugging Face ``datasets.Dataset``; a dict's
    ``labels`` or TRL ``completion_mask`` / ``assistant_masks`` say which targets carry loss).
    Each sequence counts up mod vocab with its own start and stride, so there is something to learn."""

    def __init__(self, size, seed):
        g = torch.Generator().manual_seed(seed)
        self.lengths = (torch.empty(size).log_normal_(4.0, 0.9, generator=g).long() + 8).clamp(max=max_len).tolist()
        self.starts = torch.randint(0, model_config.vocab, (size, 2), generator=g).tolist()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        start, stride = self.starts[i]
        return ((start + (1 + stride % 7) * torch.arange(self.lengths[i])) % model_config.vocab).tolist()


dataset = SyntheticTokens(args.dataset_size, args.seed)
loader = FlexSPLoader(dataset, cost, cluster, pool=pool, device=device, lengths=dataset.lengths,  # lengths known: no pass
                      vocab_size=model_config.vocab,   # rows with labels / loss masks are checked against it
                      config=LoaderConfig(batch_size=args.batch_size, seed=args.seed, lookahead=args.lookahead,
                                          plan=plan_config))


# per-step records measured against the plan (optional); with --refit the loader's planner gets refitted cost models
telemetry = None if args.run_dir is None else Telemetry(
    args.run_dir, cost, spec=model_config, device=device, peak_flops=args.peak_flops, log_every=args.log_every,
    refit=args.refit, on_refit=loader.set_cost)
executor = StepExecutor(model, optimizer, pool, cost=cost, config=train_config,   # refuses a cost model that assumed more sharding
                        probe=None if telemetry is None else telemetry.probe)


def describe(plan):
    """e.g. ``[4] [2 1 1]``: the group degrees of each micro-batch."""
    return " ".join("[" + " ".join(str(g.degree) for g in mb.groups) + "]" for mb in plan.micro_batches)


# -----------------------------------------------------------------------------------------------
# training loop: each loader step is this rank's share of one planned global batch
step = 0
while step < args.steps:
    for batch in loader:   # one epoch; the next global batches are being planned meanwhile
        result = executor.step(batch)   # checks on every rank, then forward/backward per micro-batch, one update
        log(f"step {step:3d} | loss {result.loss:.4f} | {batch.num_tokens} tokens in {len(batch.indices)} seqs "
            f"(max {max(batch.lengths)}) | {batch.num_tokens / result.seconds:,.0f} tok/s | waited "
            f"{batch.plan_wait:.2f}s for the plan | groups {describe(batch.plan)}")
        step += 1
        if step == args.steps:
            break

state = loader.state_dict()   # save it with the model to resume at the next unseen global batch
loader.close()
if telemetry is not None:
    telemetry.close()
    log(f"telemetry: {telemetry.records} step records in {args.run_dir}; `flexsp report {args.run_dir}` summarises them")
log(f"loader: {loader.stats.steps} steps, next batch {state['index']} of epoch {state['epoch']}, "
    f"{loader.stats.wait_seconds:.2f}s waiting for the loader in total (the next step is prepared while one trains)")
dist.destroy_process_group()
