"""Train a tiny LLaMA-style model with FlexSP: every step gets its own mix of SP groups.

    torchrun --nproc_per_node=4 examples/train.py      # 4 processes (NCCL on GPUs, gloo on CPU)
    python examples/train.py                           # a world of one

A dataset of variable-length token sequences goes through ``flexsp.data.FlexSPLoader``: it forms
global batches, plans each in a background thread (rank 0 plans, every rank gets the same plan),
and hands each rank the packed shards of the micro-batches it takes part in. Each step runs those
shards through the model with Ulysses attention over the step's SP groups (long sequences in big
groups, short ones alone), sums gradients over all ranks and takes one optimizer step; the update
equals training the whole batch on one device.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import flexsp
except ModuleNotFoundError:   # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import flexsp
from flexsp.data import FlexSPLoader, LoaderConfig
from flexsp.runtime import IGNORE_INDEX, GroupPool, ModelConfig, TinyLM

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
parser.add_argument("--dataset-size", type=int, default=2000, help="sequences in the synthetic dataset")
parser.add_argument("--lookahead", type=int, default=2, help="global batches planned ahead in the background")
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




class SyntheticTokens(torch.utils.data.Dataset):
    """A map-style dataset of long-tailed, variable-length token lists (any tokenized dataset works:
    lists, tensors, or dicts with ``input_ids`` such as a Hugging Face ``datasets.Dataset``).
    Each sequence counts up mod vocab with its own start and stride, so there is something to learn."""

    def __init__(self, size, seed):
        g = torch.Generator().manual_seed(seed)
        self.lengths = (torch.empty(size).log_normal_(4.0, 0.9, generator=g).long() + 8).clamp(max=max_len).tolist()
        self.starts = torch.randint(0, model_config.vocab_size, (size, 2), generator=g).tolist()

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        start, stride = self.starts[i]
        return ((start + (1 + stride % 7) * torch.arange(self.lengths[i])) % model_config.vocab_size).tolist()


dataset = SyntheticTokens(args.dataset_size, args.seed)
loader = FlexSPLoader(dataset, cost, cluster, pool=pool, device=device, lengths=dataset.lengths,  # lengths known: no pass
                      config=LoaderConfig(batch_size=args.batch_size, seed=args.seed, strategy=args.strategy,
                                          time_limit=args.time_limit, lookahead=args.lookahead))


def allreduce_gradients():
    """Sum gradients over every rank (data parallel over the world); a rank that idled adds zeros."""
    params = list(model.parameters())
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    if distributed:
        dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def describe(plan):
    """e.g. ``[4] [2 1 1]``: the group degrees of each micro-batch."""
    return " ".join("[" + " ".join(str(g.degree) for g in mb.groups) + "]" for mb in plan.micro_batches)


# -----------------------------------------------------------------------------------------------
# training loop: each loader step is this rank's share of one planned global batch
step = 0
while step < args.steps:
    for batch in loader:   # one epoch; the next global batches are being planned meanwhile
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        local_loss = torch.zeros((), device=device)
        for mb in batch.micro_batches:   # only the micro-batches this rank takes part in
            logits = model(mb.input_ids, mb.position_ids, mb.context())
            # a sum over this shard's labels / labels in the whole global batch: summed over ranks
            # (the all-reduce) it is the mean next-token loss of the global batch
            loss = F.cross_entropy(logits.float(), mb.labels, ignore_index=IGNORE_INDEX,
                                   reduction="sum") / batch.loss_tokens
            loss.backward()
            local_loss += loss.detach().float()
        allreduce_gradients()
        optimizer.step()
        if distributed:
            dist.all_reduce(local_loss)
        seconds = time.perf_counter() - t0
        log(f"step {step:3d} | loss {local_loss.item():.4f} | {batch.num_tokens} tokens in {len(batch.indices)} seqs "
            f"(max {max(batch.lengths)}) | {batch.num_tokens / seconds:,.0f} tok/s | waited {batch.plan_wait:.2f}s "
            f"for the plan | groups {describe(batch.plan)}")
        step += 1
        if step == args.steps:
            break

state = loader.state_dict()   # save it with the model to resume at the next unseen global batch
loader.close()
log(f"loader: {loader.stats.steps} steps, next batch {state['index']} of epoch {state['epoch']}, "
    f"{loader.stats.plan_wait_seconds:.2f}s waiting for plans in total")
if distributed:
    dist.destroy_process_group()
