"""An independent plan checker for the tests: re-derives every plan rule of docs/design.md from the plan's
JSON form, without calling ``Plan.validate`` or the solver, and recomputes the step time."""
from __future__ import annotations

import math

import numpy as np


def check_plan(plan_dict: dict, lengths, cost, num_gpus: int, gpus_per_node: int) -> float:
    """Assert the plan is valid; return its step time recomputed from the cost model's formula."""
    lengths = [int(x) for x in lengths]
    seen: list[int] = []
    total = 0.0
    assert plan_dict["num_gpus"] == num_gpus
    assert plan_dict["micro_batches"], "a plan needs at least one micro-batch"
    for mb in plan_dict["micro_batches"]:
        ranks_used: set[int] = set()
        slowest = 0.0
        assert mb["groups"], "empty micro-batch"
        for group in mb["groups"]:
            ranks, seqs = list(group["ranks"]), list(group["seq_ids"])
            d = len(ranks)
            assert d >= 1
            assert seqs, "empty group"
            assert ranks == list(range(ranks[0], ranks[0] + d)), f"not consecutive {ranks}"
            node = min(gpus_per_node, num_gpus)        # tiles: inside a node, or whole nodes
            if d <= node:
                assert (ranks[0] % node) % d == 0 and ranks[0] % node + d <= node, f"not a tile {ranks}"
            else:
                assert d % node == 0 and ranks[0] % d == 0, f"not a tile {ranks}"
            assert all(0 <= r < num_gpus for r in ranks)
            assert not ranks_used & set(ranks), "rank used twice in a micro-batch"
            ranks_used |= set(ranks)
            if d <= gpus_per_node:
                assert len({r // gpus_per_node for r in ranks}) == 1, f"group {ranks} crosses a node"
            tokens = sum(lengths[i] for i in seqs)
            assert tokens <= cost.token_capacity * d + 1e-9, f"{tokens} tokens overflow {d} GPUs"
            time = cost.beta1
            u = d if cost.heads is None else math.gcd(d, cost.heads)            # Ulysses part
            r = d // u                                                          # ring part
            assert group.get("ring", 1) == r, f"group of {d} should record ring {r}"
            for i in seqs:
                s = lengths[i]
                # the volume grows where the runtime copies heads past the kv heads (alltoall_replication)
                volume = cost.comm_bytes_per_token * cost.alltoall_replication.get(u, 1.0)
                comm = 0.0 if u == 1 else volume * s / d / cost.alltoall_bandwidth[u]
                attention = cost.alpha1 * s * s / d
                if r > 1:
                    width = math.gcd(u, cost.kv_heads) if cost.kv_heads else u
                    attention = max(attention, cost.ring_bytes_per_token * s * (r - 1) / (r * width) / cost.ring_bandwidth
                                    + (r - 1) * cost.ring_hop_latency)
                time += cost.alpha2 * s / d + comm + attention
            slowest = max(slowest, time)
            seen.extend(seqs)
        assert len(ranks_used) <= num_gpus
        total += slowest
    assert sorted(seen) == list(range(len(lengths))), "every sequence exactly once"
    assert math.isclose(total, plan_dict["predicted_time"], rel_tol=1e-9), (total, plan_dict["predicted_time"])
    return total


def brute_force_optimum(lengths, cost, num_gpus: int) -> float:
    """Exhaustive optimum for tiny batches: every split into micro-batches, every split of a
    micro-batch into groups, every power-of-two degree per group (subset DP over micro-batches)."""
    n = len(lengths)
    degrees = [d for d in (1, 2, 4, 8, 16, 32) if d <= num_gpus]

    times: dict[tuple[tuple[int, ...], int], float] = {}    # the enumeration meets each (group, degree) many times

    def group_time(members, d):
        key = (tuple(members), d)
        if key not in times:
            times[key] = (math.inf if sum(lengths[i] for i in members) > cost.token_capacity * d
                          else cost.group_time([lengths[i] for i in members], d))
        return times[key]

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for part in partitions(rest):
            for k in range(len(part)):
                yield part[:k] + [[first] + part[k]] + part[k + 1:]
            yield [[first]] + part

    def best_degrees(blocks, free):
        """Least max time over degree choices for these blocks within ``free`` GPUs."""
        if not blocks:
            return 0.0
        best = math.inf
        for d in degrees:
            if d > free:
                break
            t = group_time(blocks[0], d)
            if t < best:
                best = min(best, max(t, best_degrees(blocks[1:], free - d)))
        return best

    mb_best = {}
    for mask in range(1, 1 << n):
        items = [i for i in range(n) if mask >> i & 1]
        mb_best[mask] = min(best_degrees(p, num_gpus) for p in partitions(items) if len(p) <= num_gpus)
    opt = {0: 0.0}
    for mask in range(1, 1 << n):
        low = mask & -mask
        sub, best = mask, math.inf
        while sub:
            if sub & low:
                best = min(best, mb_best[sub] + opt[mask ^ sub])
            sub = (sub - 1) & mask
        opt[mask] = best
    return opt[(1 << n) - 1]
