"""The GPU step benchmark: its quick CPU mode runs every group, compares the contenders' losses, prints each
target as met or MISSED, says it measured nothing about GPUs and writes nothing into the repository; its FLOP
count reproduces the issue's H200 figure; a contender that fails (out of memory) is reported, the others go on."""
import json
import math
import re
from pathlib import Path

import pytest

from scripts import experiment, run_script

pytest.importorskip("torch")


def test_quick_cpu_run_measures_nothing_about_gpus_and_writes_outside_the_repo(tree_unchanged):
    result = run_script("gpu_step_benchmark", "--quick", timeout=600)
    assert "measured nothing about GPUs" in result.stdout
    path = Path(re.search(r"^results: (.+)$", result.stdout, re.M).group(1))
    data = json.loads(path.read_text())
    assert data["measured_on_gpu"] is False and data["device"].startswith("CPU")
    assert "experiments/results" not in str(path)
    assert set(data["groups"]) == {"tiny mixed", "hf mixed", "hf short", "hf long"}
    for name, group in data["groups"].items():
        assert group["error"] is None, name
        first = group["first_losses"]                           # same weights, same batch: same loss (fp32)
        assert max(first) - min(first) <= 1e-4 * max(first), name
        assert all(c["ms"] > 0 and c["rounds"] >= 1 and not c["failed"] for c in group["contenders"].values())
    assert len(data["verdicts"]) == 7
    for v in data["verdicts"]:
        assert ("met" if v["met"] else "MISSED") in result.stdout.split(v["what"])[1].splitlines()[0]


def test_flops_reproduce_the_issue_s_h200_figure():
    """Issue 36: HF native per sequence, 460 ms a step at 462 TFLOP/s (6N + causal attention)."""
    bench = experiment("gpu_step_benchmark")
    flops = bench.SPEC.training_flops(bench.MIXED)
    assert flops / 0.460 / 1e12 == pytest.approx(462, rel=5e-3)
    assert sum(bench.MIXED) == 33792


def test_a_failing_contender_is_reported_and_the_others_go_on():
    bench = experiment("gpu_step_benchmark")

    class Meter(bench.HostMeter):
        recoverable = (MemoryError,)

    class Fake:
        def __init__(self, name, fails):
            self.name, self.fails = name, fails
            self.seconds, self.cpu, self.losses, self.peak_mib, self.failed = [], [], [], float("nan"), None
            self.optimizer = type("O", (), {"zero_grad": lambda self, set_to_none=True: None})()

        step, fail = bench.Contender.step, bench.Contender.fail

        def run(self):
            if self.fails:
                raise MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return 1.0

    good, bad = Fake("hf each", False), Fake("flexsp hf", True)
    first = bench.measure([bad, good], 3, Meter())
    assert math.isnan(first[0]) and first[1] == 1.0
    assert bad.failed.startswith("MemoryError: CUDA out of memory") and not bad.seconds
    assert len(good.seconds) == 3 and good.peak_mib == good.peak_mib
    summaries = {"hf mixed": {"lengths": [4, 2], "summary": {c.name: bench.summary(c, 1e9) for c in (good, bad)}}}
    verdicts = bench.verdicts(summaries)
    assert verdicts and not any(met for *_, met in verdicts)     # nothing measured for flexsp hf: never met
    text, ok = bench.report(summaries, {"device": "CPU x", "torch": "t", "transformers": "t", "liger_kernel": None,
                                        "lm_head_loss": "own"}, bench.QUICK_SPEC, gpu=False)
    assert not ok and "MemoryError: CUDA out of memory" in text and "MISSED" in text


def test_the_tiny_group_sizes_itself_to_an_80gb_h100_and_keeps_full_size_on_a_141gb_h200():
    """The plain loop's kept logits beside two models' fp32 AdamW states: ~91 GB at 33,792 tokens."""
    bench = experiment("gpu_step_benchmark")
    gib = 2**30
    full = sum(bench.MIXED)
    h200, text200 = bench.fit_tiny(bench.SPEC, bench.MIXED, 140 * gib)
    h100, text100 = bench.fit_tiny(bench.SPEC, bench.MIXED, 79.6 * gib)
    assert sum(h200) == full and text200.startswith("full size: 33,792 tokens")
    assert bench.tiny_peak_bytes(bench.SPEC, bench.MIXED) > bench.FIT_SHARE * 79.6 * gib     # why it must shrink
    assert sum(h100) < full and bench.tiny_peak_bytes(bench.SPEC, h100) <= bench.FIT_SHARE * 79.6 * gib
    assert len(h100) == len(bench.MIXED) and "tokens / " in text100 and f"{sum(h100):,} tokens" in text100
