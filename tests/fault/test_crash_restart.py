"""Kill one of four gloo ranks mid-epoch (SIGKILL), relaunch from the last checkpoint, finish the epoch:
every sequence is trained exactly once per epoch, and the final fp64 parameters equal a run that was
never interrupted (computed in the first launch, before its crashing job starts)."""
import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fault.common import SeenCounter, build, dataset, flat_params, train_step  # noqa: E402
from fault.launcher import cue_path, launch  # noqa: E402

WORLD, NUM_SEQS, EVERY, KILL_AFTER, VICTIM = 4, 40, 2, 5, 2


def _job(rank, world, directory, attempt, reference):
    from flexsp.checkpoint import Checkpointer
    from flexsp.runtime import GroupPool
    data = dataset(NUM_SEQS)
    pool = GroupPool()
    out = {}
    if reference:   # the uninterrupted run, no checkpoints
        model, _, loader, executor = build(world, data, pool=pool)
        with loader:
            for step in loader:
                train_step(executor, step, data)
        if rank == 0:   # this launch never returns: keep the uninterrupted result on disk
            torch.save(flat_params(model), Path(directory) / "reference.pt")
    model, opt, loader, executor = build(world, data, pool=pool)
    seen = SeenCounter(len(data))
    log = open(Path(directory) / f"log-rank{rank}.jsonl", "a")
    with loader, log, Checkpointer(Path(directory) / "ckpt", model, opt, loader=loader, every=EVERY,
                                   extra={"seen": seen}, timeout=10) as ckpt:
        out["restored"] = ckpt.restore()
        for step in loader:
            result = train_step(executor, step, data)
            seen.add(step.indices)
            log.write(json.dumps({"attempt": attempt, "step": ckpt.step + 1,
                                  "seqs": [step.indices[s] for s in result.seq_ids]}) + "\n")
            log.flush()
            if rank == VICTIM and attempt == 0 and ckpt.step + 1 == KILL_AFTER:
                cue_path(directory, rank).touch()   # the launcher SIGKILLs this rank now
                time.sleep(30)
            ckpt.step_done()
    out.update(params=flat_params(model), seen=seen.counts, steps=ckpt.step)
    return out


def test_sigkill_one_rank_of_four_then_restart_trains_every_sequence_once(tmp_path):
    first = launch(_job, WORLD, str(tmp_path), 0, True, kill_rank=VICTIM, cue_dir=str(tmp_path), timeout=60)
    assert first.killed == VICTIM and first.exitcodes[VICTIM] == -9
    assert all(first.exitcodes[r] != 0 for r in range(WORLD))     # nobody finished the epoch
    assert not first.values
    second = launch(_job, WORLD, str(tmp_path), 1, False, timeout=60)
    assert second.errors == {} and sorted(second.values) == list(range(WORLD)), second.errors
    restored = {v["restored"] for v in second.values.values()}
    assert restored == {KILL_AFTER - KILL_AFTER % EVERY}            # the last checkpoint before the kill
    # the training log, cut at the restored step: each sequence trained exactly once in the epoch
    entries = [json.loads(line) for r in range(WORLD) for line in (tmp_path / f"log-rank{r}.jsonl").open()]
    start = restored.pop()
    lineage = [e for e in entries if (e["attempt"] == 0 and e["step"] <= start) or e["attempt"] == 1]
    per_step = {}
    for e in lineage:
        per_step.setdefault(e["step"], set()).update(e["seqs"])
    trained = sorted(s for seqs in per_step.values() for s in seqs)
    assert trained == list(range(NUM_SEQS))
    assert [e for e in entries if e["attempt"] == 0 and e["step"] > start]   # work was really lost and redone
    for value in second.values.values():
        assert value["seen"].tolist() == [1] * NUM_SEQS              # the checkpointed count agrees
    params = [second.values[r]["params"] for r in range(WORLD)]
    assert all((p == params[0]).all() for p in params)
    reference = torch.load(tmp_path / "reference.pt").numpy()
    assert (params[0] == reference).all()                          # fp64, bit for bit


def _sigterm_job(rank, world, directory):
    import os
    import signal

    from flexsp.checkpoint import Checkpointer, layout
    data = dataset(NUM_SEQS)
    model, opt, loader, executor = build(world, data)
    with loader, Checkpointer(directory, model, opt, loader=loader, every=0, timeout=10) as ckpt:
        for step in loader:
            train_step(executor, step, data)
            if rank == 1 and ckpt.step + 1 == 3:
                os.kill(os.getpid(), signal.SIGTERM)    # only rank 1 is told, as when a node is drained
            if ckpt.step_done():
                break
        return {"step": ckpt.step, "saved": [s for s, _ in layout.committed(Path(directory))],
                "next_batch": loader.state_dict()["index"]}


def test_sigterm_on_one_rank_checkpoints_and_stops_every_rank_at_the_same_step(tmp_path):
    from runtime.distributed import run_distributed
    out = run_distributed(_sigterm_job, WORLD, str(tmp_path), timeout=60)
    assert out == [{"step": 3, "saved": [3], "next_batch": 3}] * WORLD
