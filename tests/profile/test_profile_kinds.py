"""A layer of each kind timed and fitted apart (flexsp.profile.kinds / fit.fit_kinds), and its preset format.

Timings on a shared CPU are too noisy to hold a fit to a tolerance, so the sweeps here are clocked by the FLOPs
torch's ``FlopCounterMode`` counts in the runtime's own kernels (the CPU flash op, the explicit masked path,
chunked bounds): deterministic work that grows with length as the kernels' time does. One CLI run uses the real
CPU clock for the wiring (no tolerance asserted there)."""
import copy
import re
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import flexsp.profile.kinds as kinds_module
import flexsp.runtime.kernels.sdpa  # noqa: F401  (registers the CPU flash op's FLOP formula)
from flexsp import CostModelError
from flexsp.plan import measured_presets
from flexsp.plan.layers import LayerKind, pairs
from flexsp.plan.specs import ModelSpec
from flexsp.profile import assemble_cost_model
from flexsp.profile.cli import main
from flexsp.profile.compute import DeviceSetup
from flexsp.profile.fit import fit_kind, fit_kinds
from flexsp.profile.kinds import fit_sweep, kind_lengths, kind_sweep
from flexsp.profile.preflight import FIT_ERROR_LIMIT

W = 64
SPEC = ModelSpec(4, 64, 4, 2, 128, 256, "mix", kinds=((LayerKind("window", W), 2), (LayerKind("chunk", W), 1),
                                                       (LayerKind(), 1)))
LENGTHS = [32, 64, 128, 256, 512]


def _flop_sweep(spec=SPEC, lengths=LENGTHS):
    with FlopCounterMode(display=False) as counter:
        return kind_sweep(spec, DeviceSetup.resolve("cpu"), lengths, blocks=1, repeats=1, warmup=0,
                          clock=lambda: float(counter.get_total_flops()))


def _banded(q, k, v, ctx, features=None, sinks=None):
    """CPU stand-in for flash-attn's window (``window_size``): each block of W queries against its last 2W keys
    only, so the work is ~s W, as flash-attn's. Other layers: the runtime's."""
    if features is None or features.window is None:
        return _real(q, k, v, ctx, features, sinks)
    w, s, group = features.window, q.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = []
    for a in range(0, s, w):
        b, lo = min(a + w, s), max(0, a - w + 1)
        pq, pk = torch.arange(a, b)[:, None], torch.arange(lo, b)[None, :]
        out.append(F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[lo:b].transpose(0, 1),
                                                  v[lo:b].transpose(0, 1),
                                                  attn_mask=(pk <= pq) & (pq - pk < w)).transpose(0, 1))
    return torch.cat(out)


_real = kinds_module.sp_attention


def _per_layer(sweep, i):
    return (np.asarray(sweep.kinds[i]) - np.asarray(sweep.base)) / sweep.blocks


def _check_each_kind_predicted(sweep, model):
    """Every timed kind's fit predicts its own measured layer, within the profile's error limit."""
    for i, (kind, _) in enumerate(sweep.timed):
        fit = next(k for k in model.kinds if (k.mixer, k.size) == (kind.mixer, kind.size))
        predicted = np.array([fit.predict(n) for n in sweep.lengths])
        error = np.abs(predicted / _per_layer(sweep, i) - 1)
        assert error.mean() <= FIT_ERROR_LIMIT and fit.mean_abs_error <= FIT_ERROR_LIMIT, (kind, error)


def test_runtime_cpu_kernels_fitted_per_kind():
    sweep = _flop_sweep()
    model = fit_sweep(sweep)
    _check_each_kind_predicted(sweep, model)
    by = {k.mixer: k for k in model.kinds}
    assert [k.layers for k in model.kinds] == [2, 1, 1]
    # chunks cut the bounds, so the CPU flash op does the chunk's pairs only: far below a full layer at 8 chunks
    assert by["chunk"].work == "pairs" and by["full"].work == "square"
    s = 8 * W
    assert by["chunk"].alpha * pairs(s, "chunk", W) < 0.25 * by["full"].alpha * s * s
    # the CPU's windowed path bands each query tile's keys (sdpa.key_band): fitted by its pairs, far below full
    assert by["window"].work == "pairs"
    assert by["window"].alpha * pairs(s, "window", W) < by["full"].alpha * s * s
    far = 64 * W                                 # linear beyond the window: a small share of a full layer far out
    assert by["window"].alpha * pairs(far, "window", W) < 0.1 * by["full"].alpha * far * far
    assert model.window_alpha == {W: pytest.approx(2 * by["window"].alpha)}
    assert model.chunk_alpha == {W: pytest.approx(by["chunk"].alpha)}
    assert model.total.alpha1 == pytest.approx(by["full"].alpha)


def test_window_kernel_that_skips_masked_blocks_gets_a_window_term(monkeypatch):
    monkeypatch.setattr(kinds_module, "sp_attention", _banded)
    gemma = ModelSpec(6, 64, 4, 2, 128, 256, "gemma-like", kinds=((LayerKind("window", W), 5), (LayerKind(), 1)))
    lengths = [32, 64, 128, 256, 512, 1024]
    sweep = _flop_sweep(gemma, lengths)
    model = fit_sweep(sweep)
    _check_each_kind_predicted(sweep, model)
    window, full = model.kinds
    assert window.work == "pairs" and window.layers == 5 and full.layers == 1
    for s in (8 * W, 16 * W):       # lengths >> window: its attention term is far below a full layer's
        assert window.alpha * pairs(s, "window", W) < 0.3 * full.alpha * s * s
    # the cost model the profile writes: alpha1 from the full layer, window_alpha[W] from the five windowed ones
    cost = assemble_cost_model(gemma, model.total, 10**6, kinds=model, environment={"device": "cpu", "torch": "x"})
    assert cost.alpha1 == pytest.approx(full.alpha) and cost.window_alpha == {W: pytest.approx(5 * window.alpha)}
    measured = np.asarray([p.measured for p in model.total.points])
    predicted = np.asarray([float(cost.seq_time(float(n), 1)) + cost.beta1 for n in sorted(set(lengths))])
    assert np.abs(predicted / measured - 1).max() <= FIT_ERROR_LIMIT
    assert [k["work"] for k in cost.meta["kinds"]] == ["pairs", "square"]


def test_fit_kind_tells_pair_count_from_square():
    xs = np.array([64, 128, 256, 512, 1024, 2048, 4096], dtype=float)
    linear = 3e-5 * xs + 2e-3
    banded = 4e-8 * pairs(xs, "window", 256) + linear
    fit = fit_kind("window", 256, 5, xs, banded)
    assert fit.work == "pairs" and fit.alpha == pytest.approx(4e-8, rel=1e-6) and fit.max_abs_error < 1e-6
    assert fit_kind("window", 256, 5, xs, 4e-8 * xs * xs + linear).work == "square"
    # a small attention share under 2% noise: a spurious s^2 would grow without bound; the pair count is kept
    rng = np.random.default_rng(0)
    small = (1e-10 * pairs(xs, "chunk", 256) + linear) * rng.lognormal(0, 0.02, xs.size)
    assert fit_kind("chunk", 256, 1, xs, small).work == "pairs"
    assert fit_kind("linear", 0, 3, xs, linear).work == "none"


def test_lengths_below_a_window_are_added():
    spec = ModelSpec(6, 64, 4, 2, 128, 256, "g", kinds=((LayerKind("window", 1024), 5), (LayerKind(), 1)))
    grid, added = kind_lengths([1024, 2048, 4096], spec)
    assert added == [256, 512] and grid == [256, 512, 1024, 2048, 4096]
    assert kind_lengths([128, 512, 2048], spec)[1] == []


def test_linear_layers_not_timed_are_said_plainly():
    qwen = ModelSpec(4, 64, 4, 2, 128, 256, "hybrid", kinds=((LayerKind("linear"), 3), (LayerKind(), 1)))
    sweep = _flop_sweep(qwen, LENGTHS[:4])
    assert [k.mixer for k, _ in sweep.timed] == ["full"]
    assert [(k.mixer, n) for k, n, _ in sweep.untimed] == [("linear", 3)]
    assert "no linear-attention layer" in sweep.untimed[0][2]
    model = fit_sweep(sweep)
    linear = next(k for k in model.kinds if k.mixer == "linear")
    assert linear.estimated and linear.work == "none" and linear.alpha2 == model.kinds[0].alpha2
    cost = assemble_cost_model(qwen, model.total, 10**6, kinds=model)
    assert any(e.startswith("layer kind linear (3 layers): not timed") for e in cost.meta["estimates"])


# --- the measured-preset format ---------------------------------------------------------------------
def _kinds_profile():
    """A profile JSON with per-kind fits, from exact synthetic layer times (no torch run)."""
    spec = ModelSpec(6, 64, 4, 2, 128, 256, "g", kinds=((LayerKind("window", 128), 5), (LayerKind(), 1)))
    xs = np.array([32, 64, 128, 256, 512, 1024], dtype=float)
    base = 1e-5 * xs + 1e-3
    window = base + 2 * (3e-8 * pairs(xs, "window", 128) + 2e-5 * xs + 1e-3)
    full = base + 2 * (3e-8 * xs * xs + 2e-5 * xs + 1e-3)
    model = fit_kinds(xs, base, [("window", 128, 5, window), ("full", 0, 1, full)], 2)
    cost = assemble_cost_model(spec, model.total, 5000, kinds=model,
                               memory={"bytes_per_token": 1e4, "memory_bytes": 2**30, "usable_fraction": 0.9},
                               environment={"device": "cpu", "torch": "x", "lengths": xs.astype(int).tolist()})
    return cost.to_dict()


def test_preset_round_trip_keeps_kinds(tmp_path):
    document = measured_presets.wrap_profile(_kinds_profile(), "cpu-g", driver="none", command="flexsp profile")
    assert document["version"] == 2
    (tmp_path / "cpu-g.json").write_text(json.dumps(document))
    cost = measured_presets.measured_cost_model("cpu-g", num_gpus=8, folder=tmp_path)
    assert cost.window_alpha == {128: pytest.approx(5 * 3e-8)} and cost.alpha1 == pytest.approx(3e-8)
    assert [k["mixer"] for k in cost.meta["kinds"]] == ["window", "full"]
    assert "5 x window 128 (pairs), 1 x full (square)" in cost.meta["parts"]["compute"]


def test_version_one_presets_load_unchanged():
    for path in measured_presets.preset_files().values():
        raw = json.loads(path.read_text())
        assert raw["version"] == 1 and "kinds" not in raw["profile"]["meta"]
        assert measured_presets.read_preset(path)["profile"] == raw["profile"]
    assert measured_presets.measured_cost_model("h200-llama3-8b").window_alpha == {}


@pytest.mark.parametrize("field, value, message", [
    ("alpha", "fast", "profile.meta.kinds[0].alpha must be a number"),
    ("work", "none", "profile.meta.kinds[0].work of a window layer must be pairs or square"),
    ("layers", 4, "profile.meta.kinds cover 5 layers but the model has 6"),
    ("size", 0, "a window layer needs a window of at least 1 token"),
    ("points", list(range(300)), "points has 300 entries"),
])
def test_corrupt_kind_field_is_one_line_error(tmp_path, capsys, field, value, message):
    document = measured_presets.wrap_profile(_kinds_profile(), "cpu-g", driver="none", command="flexsp profile")
    document["profile"]["meta"]["kinds"][0][field] = value
    path = tmp_path / "cpu-g.json"
    path.write_text(json.dumps(document))
    with pytest.raises(CostModelError, match=re.escape(message)) as caught:
        measured_presets.read_preset(path)
    assert "\n" not in str(caught.value)
    old = copy.deepcopy(document)
    old["version"], old["profile"]["meta"]["kinds"][0][field] = 1, _kinds_profile()["meta"]["kinds"][0][field]
    path.write_text(json.dumps(old))
    with pytest.raises(CostModelError, match="needs measured preset format version 2"):
        measured_presets.read_preset(path)


def _cli_profile(model: str, layers: int, out, capsys):
    """``flexsp profile`` of a tiny ``model`` preset (one layer of each kind run): (exit code, captured output)."""
    rc = main(["profile", "--model", model, "--layers", str(layers), "--hidden", "32", "--heads", "2", "--kv-heads",
               "1", "--ffn", "64", "--vocab", "64", "--lengths", "32,64,128,192,256", "--memory-lengths", "32,64",
               "--memory-gb", "1", "--repeats", "2", "--warmup", "1", "--statistic", "min", "--force",
               "--run-layers", "1", "-o", str(out)])
    return rc, capsys.readouterr()


def test_cli_profiles_each_kind(tmp_path, capsys):
    out = tmp_path / "g.json"
    rc, captured = _cli_profile("gemma-3-27b", 6, out, capsys)
    text = captured.out
    assert rc == 0, captured.err
    assert "a layer of each kind timed apart (5 x window 1024, 1 x full)" in text
    meta = json.loads(out.read_text())["meta"]
    assert [(k["mixer"], k["size"], k["layers"]) for k in meta["kinds"]] == [("window", 1024, 5), ("full", 0, 1)]
    assert not any("not fitted apart" in e for e in meta["estimates"])


def test_transformers_hybrid_times_its_linear_attention_layers():
    """Through --hf-config's builder the runtime runs Gated DeltaNet (transformers' own recurrence under FlexSP's
    Ulysses wrapper): a Qwen3.5 hybrid's linear layer is timed, fitted with no pair term, and nothing is estimated."""
    pytest.importorskip("transformers")
    from flexsp.hf.families import tiny_config
    from flexsp.plan.specs import spec_from_hf_config
    from flexsp.profile.kinds import hf_kind_builder, timed_kinds

    config = tiny_config("qwen3_5")
    spec = spec_from_hf_config(config)
    builders = {k: hf_kind_builder(config, spec, k, max_seqlen=256) for k, _ in timed_kinds(spec)}
    with FlopCounterMode(display=False) as counter:
        sweep = kind_sweep(spec, DeviceSetup.resolve("cpu"), [64, 128, 192, 256], blocks=1, repeats=1, warmup=0,
                           clock=lambda: float(counter.get_total_flops()), builders=builders)
    assert sweep.untimed == () and sorted(k.mixer for k, _ in sweep.timed) == ["full", "linear"]
    model = fit_sweep(sweep)
    _check_each_kind_predicted(sweep, model)
    linear = next(k for k in model.kinds if k.mixer == "linear")
    assert linear.work == "none" and linear.alpha == 0 and not linear.estimated and linear.alpha2 > 0


def test_cli_says_plainly_which_kinds_it_could_not_time(tmp_path, capsys):
    out = tmp_path / "q.json"
    rc, captured = _cli_profile("qwen3.5-27b", 4, out, capsys)
    assert rc == 0, captured.err
    assert "NOT TIMED: 3 x linear layers: the runtime's TinyLM has no linear-attention layer" in captured.out
    profile = json.loads(out.read_text())
    assert any(e.startswith("layer kind linear (3 layers): not timed") for e in profile["meta"]["estimates"])
    document = measured_presets.wrap_profile(profile, "cpu-q", driver="none", command="flexsp profile")
    assert "1 x full (square), 3 x linear (NOT TIMED, estimated)" in measured_presets.parts(document)["compute"]
