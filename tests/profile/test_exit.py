"""``flexsp profile`` launched like torchrun (the command creates the process group itself) exits 0 on
every rank with its groups destroyed in order (issue 31, point 6): before, a 4-rank run aborted
(SIGABRT) at interpreter exit in about one run of three, as gloo groups went down in any order."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from runtime.distributed import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "64",
        "--lengths", "32,64,128,256", "--repeats", "1", "--warmup", "0", "--clock", "cpu", "--comm-sizes", "256K,4M,16M",
        "--memory-gb", "1", "--threads", "1", "--quiet", "--force"]


def test_profile_under_a_torchrun_style_launch_exits_cleanly_on_every_rank(tmp_path):
    world, port = 2, free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "flexsp.cli", "profile", *ARGS, "-o",
                                       str(tmp_path / "cost.json")], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("flexsp profile did not finish within 240 s")
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, [err[-2000:] for _, err in outs]
    assert (tmp_path / "cost.json").is_file()
