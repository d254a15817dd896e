"""gloo: FSDP2-sharded states saved by 4 ranks and restored on 2 (sharded and unsharded); a world
change that would alter the epoch's sequences is refused with the reason on every rank."""
import pytest

torch = pytest.importorskip("torch")

from runtime.distributed import run_distributed  # noqa: E402

from fault.common import MODEL, cost_model, dataset  # noqa: E402

TIMEOUT = 90


def _model(fsdp: bool):
    from torch.distributed.fsdp import fully_shard

    from flexsp.runtime import TinyLM
    torch.manual_seed(0)
    model = TinyLM(MODEL).to(torch.float64)
    if fsdp:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    exp_avg = {k: v["exp_avg"] for k, v in osd["state"].items()}
    return {"model": dict(msd), "exp_avg": exp_avg}


def _skip_loader(world, pool):
    import flexsp
    from flexsp.data import FlexSPLoader, LoaderConfig
    data = [[1] * n for n in (20, 90, 150, 30, 200, 40, 60, 10)]   # 150, 200 fit 4 GPUs (256), not 2 (128)
    config = LoaderConfig(batch_size=2, on_too_long="skip", lookahead=0, plan=flexsp.PlanConfig(strategy="greedy"))
    return FlexSPLoader(data, cost_model(), flexsp.Cluster(world, world), config, pool=pool)


def _save_worker(rank, world, directory):
    from flexsp.checkpoint import Checkpointer
    from flexsp.runtime import GroupPool
    model, opt = _model(fsdp=True)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):   # each rank trains on its own tokens; FSDP averages the gradients
        opt.zero_grad()
        model(torch.randint(0, MODEL.vocab, (12,), generator=gen)).square().mean().backward()
        opt.step()
    with Checkpointer(f"{directory}/fsdp", model, opt, every=0, timeout=20) as ckpt:
        ckpt.step = 2
        ckpt.save()
    plain, popt = _model(fsdp=False)
    with _skip_loader(world, GroupPool()) as loader, \
            Checkpointer(f"{directory}/skip", plain, popt, loader=loader, every=0, timeout=20) as ckpt:
        next(iter(loader))
        ckpt.save()
    return _full(model, opt)


def _load_worker(rank, world, directory):
    from flexsp.checkpoint import Checkpointer, CheckpointError
    from flexsp.runtime import GroupPool
    out = {}
    for name, fsdp in (("fsdp", True), ("plain", False)):
        model, opt = _model(fsdp=fsdp)
        with Checkpointer(f"{directory}/fsdp", model, opt, timeout=20) as ckpt:
            assert ckpt.restore() == 2
        out[name] = _full(model, opt)
    plain, popt = _model(fsdp=False)
    with _skip_loader(world, GroupPool()) as loader, \
            Checkpointer(f"{directory}/skip", plain, popt, loader=loader, timeout=20) as ckpt:
        try:
            ckpt.restore()
        except CheckpointError as exc:
            out["refused"] = str(exc)
    # a save that fails on rank 0 (its directory is a file) fails on every rank with the same error
    blocker = f"{directory}/not-a-directory"
    if rank == 0:
        open(blocker, "w").close()
    with Checkpointer(blocker, plain, popt, timeout=20) as ckpt:
        try:
            ckpt.save()
        except CheckpointError as exc:
            out["save_failed"] = str(exc)
    return out


def test_fsdp2_checkpoint_of_4_ranks_restores_on_2_sharded_and_unsharded(tmp_path):
    saved = run_distributed(_save_worker, 4, str(tmp_path), timeout=TIMEOUT)
    loaded = run_distributed(_load_worker, 2, str(tmp_path), timeout=TIMEOUT)
    reference = saved[0]
    assert all(set(s["model"]) == set(reference["model"]) for s in saved)
    for out in loaded:
        for name in ("fsdp", "plain"):
            for key, value in reference["model"].items():
                assert (out[name]["model"][key] == value).all(), (name, key)
            for key, value in reference["exp_avg"].items():
                assert (out[name]["exp_avg"][key] == value).all(), (name, key)
    messages = {out["refused"] for out in loaded}
    assert len(messages) == 1                    # the same error on every rank
    message = messages.pop()
    assert "flexsp.json: the epoch saved by 4 ranks left out 0 too-long sequence(s)" in message
    assert "different set (2)" in message and "resume on 4 ranks" in message
    failed = {out.get("save_failed") for out in loaded}
    assert len(failed) == 1 and "not-a-directory/step-000000000 failed on rank 0: FileExistsError" in failed.pop()


def _stale_listing_worker(rank, world, directory):
    """Rank 1 sees the checkpoint directory without its newest file, as a node's cached listing of a shared
    filesystem may: the manifest must still name every file (one listing, rank 0's), so the checkpoint restores."""
    from flexsp.checkpoint import Checkpointer, layout
    if rank == 1:
        real = layout.files_of
        layout.files_of = lambda path: real(path)[:-1]
    model, opt = _model(fsdp=False)
    with Checkpointer(directory, model, opt, every=0, timeout=20) as ckpt:
        ckpt.step = 3
        ckpt.save()
    model, opt = _model(fsdp=False)
    with Checkpointer(directory, model, opt, every=0, timeout=20) as ckpt:
        return ckpt.restore()


def test_a_stale_directory_listing_on_one_rank_leaves_the_manifest_whole(tmp_path):
    assert run_distributed(_stale_listing_worker, 2, str(tmp_path / "ckpt"), timeout=TIMEOUT) == [3, 3]
