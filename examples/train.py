"""Train a tiny LLaMA-style model with FlexSP: every step gets its own mix of SP groups.

    torchrun --nproc_per_node=4 examples/train.py      # 4 processes (NCCL on GPUs, gloo on CPU)
    python examples/train.py                           # a world of one

Each step: draw a batch of variable-length sequences, let the planner split the GPUs into
power-of-two SP groups (long sequences in big groups, short ones alone), run the plan with Ulysses
attention, and take one optimizer step. The update equals training the whole batch on one device.
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
from flexsp.runtime import GroupPool, ModelConfig, StepExecutor, TinyLM

# -----------------------------------------------------------------------------------------------
# config
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=24, help="sequences per global batch")
parser.add_argument("--max-len", type=int, default=600, help="longest sequence, in tokens")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--strategy", default="flexsp", help="flexsp, batchada, static, greedy")
parser.add_argument("--time-limit", type=float, default=2.0, help="planner seconds per step")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()
model_config = ModelConfig(vocab_size=256, hidden=64, num_layers=2, num_heads=8, num_kv_heads=2, mlp_hidden=128)

# -----------------------------------------------------------------------------------------------
# distributed setup: torchrun sets RANK/WORLD_SIZE; plain python is a world of one
distributed = "RANK" in os.environ
use_cuda = torch.cuda.is_available()
if distributed:
    dist.init_process_group("nccl" if use_cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
else:
    local_rank = 0
rank = dist.get_rank() if distributed else 0
world = dist.get_world_size() if distributed else 1
device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
if use_cuda:
    torch.cuda.set_device(device)
master = rank == 0


def log(*parts):
    if master:
        print(*parts, flush=True)


# Every SP group a plan can use, created once (collective) and reused by every step.
pool = GroupPool()
log(f"world {world} ({'nccl' if use_cuda and distributed else 'gloo' if distributed else 'no process group'}), "
    f"device {device}: {pool.stats.count} SP groups created in {pool.stats.seconds:.3f}s, "
    f"{pool.stats.per_rank} communicators on this rank")

# -----------------------------------------------------------------------------------------------
# model and optimizer: the same seed on every rank gives the same replica
torch.manual_seed(args.seed)
model = TinyLM(model_config).to(device)
if use_cuda:
    model = model.to(torch.bfloat16)   # lets the flash-attn backend run when it is installed
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
executor = StepExecutor(model, optimizer, pool)
log(f"model: {sum(p.numel() for p in model.parameters()) / 1e3:.1f}K parameters, {model_config}")

# -----------------------------------------------------------------------------------------------
# the planner's view of this machine: made-up numbers that suit a tiny model
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
cluster = flexsp.Cluster(num_gpus=world, gpus_per_node=1 << (local_world - 1).bit_length())
token_capacity = 256   # tokens one GPU may hold: a 600-token sequence needs a group of 4
cost = flexsp.CostModel(
    alpha1=2e-9,                                           # s per token^2 (attention)
    alpha2=2e-6,                                           # s per token (everything else)
    beta1=1e-4,                                            # s per group per micro-batch
    comm_bytes_per_token=4 * 2 * model_config.num_layers * model_config.hidden * 4,
    alltoall_bandwidth={d: 2e9 / d for d in cluster.degrees if d > 1},
    token_capacity=token_capacity,
)
max_len = min(args.max_len, token_capacity * world)   # the longest sequence must fit the whole world


def get_batch(step):
    """Synthetic long-tailed lengths; each sequence counts up mod vocab with its own start and stride.

    Every rank draws the same batch (same seed); a real dataloader would share lengths instead.
    """
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    lengths = (torch.empty(args.batch_size).log_normal_(4.0, 0.9, generator=g).long() + 8).clamp(max=max_len).tolist()
    batch = []
    for n in lengths:
        start, stride = torch.randint(0, model_config.vocab_size, (2,), generator=g).tolist()
        batch.append((start + (1 + stride % 7) * torch.arange(n)) % model_config.vocab_size)
    return lengths, batch


def get_plan(lengths):
    """Plan on rank 0 and broadcast: a time-limited solver need not give every rank the same answer."""
    box = [flexsp.plan_batch(lengths, cost, cluster, strategy=args.strategy,
                             time_limit=args.time_limit).to_dict() if master else None]
    if distributed:
        dist.broadcast_object_list(box, src=0, device=device if use_cuda else None)
    return flexsp.Plan.from_dict(box[0])


def describe(plan):
    """e.g. ``[4] [2 1 1]``: the group degrees of each micro-batch."""
    return " ".join("[" + " ".join(str(g.degree) for g in mb.groups) + "]" for mb in plan.micro_batches)


# -----------------------------------------------------------------------------------------------
# training loop
for step in range(args.steps):
    lengths, batch = get_batch(step)
    t0 = time.perf_counter()
    plan = get_plan(lengths)
    plan_seconds = time.perf_counter() - t0
    result = executor.step(plan, batch)
    tokens = sum(lengths)
    log(f"step {step:3d} | loss {result.loss:.4f} | {tokens} tokens in {len(lengths)} seqs (max {max(lengths)}) | "
        f"{tokens / result.seconds:,.0f} tok/s | plan {plan_seconds:.2f}s | groups {describe(plan)}")

if distributed:
    dist.destroy_process_group()
