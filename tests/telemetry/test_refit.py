"""Online refit, on CPU and deterministic: measured group times come from a "true" cost model plus
2% noise and 5% outliers (x3); planning starts from a model whose alpha1 is 10x too large. The
refit brings the median predicted-vs-measured group error below 5% within 3 steps, the plans change
(faster by the true model, within 0.5% of the true model's own plans), and capacity never moves."""
import dataclasses

import numpy as np
import pytest

import flexsp
from flexsp.errors import CostModelError
from flexsp.telemetry.refit import Refitter, RefitConfig, relative_error

TRUE = flexsp.cost_from_preset("gpt-7b", context=64 * 1024, num_gpus=8)
WRONG = dataclasses.replace(TRUE, alpha1=TRUE.alpha1 * 10)
CLUSTER = flexsp.Cluster(8, 8)
BOUND, WITHIN, STEPS = 0.05, 3, 10


def _lengths(rng):
    return np.clip(rng.lognormal(8.5, 1.2, 32).astype(int), 128, 30000)


def _measure(plan, lengths, rng):
    """(degree, lengths, seconds) of every group as the "true" machine runs it."""
    out = []
    for mb in plan.micro_batches:
        for g in mb.groups:
            glen = [int(lengths[s]) for s in g.seq_ids]
            seconds = TRUE.group_time(glen, g.degree) * (1 + 0.02 * rng.standard_normal())
            out.append((g.degree, glen, seconds * 3 if rng.random() < 0.05 else seconds))
    return out


def _true_time(plan, lengths):
    return sum(max(TRUE.group_time([int(lengths[s]) for s in g.seq_ids], g.degree) for g in mb.groups)
               for mb in plan.micro_batches)


def _closed_loop(refit: bool, seed=0):
    rng = np.random.default_rng(seed)
    refitter, cost = Refitter(WRONG, RefitConfig(min_points=8)), WRONG
    errors, plans, versions = [], [], []
    for _ in range(STEPS):
        lengths = _lengths(rng)
        plan = flexsp.plan_batch(lengths, cost, CLUSTER, strategy="greedy")
        plan.validate(lengths=lengths)
        assert all(cost.fits([lengths[s] for s in g.seq_ids], g.degree) for mb in plan.micro_batches for g in mb.groups)
        measured = _measure(plan, lengths, rng)
        errors.append(float(np.median([abs(cost.group_time(glen, d) - t) / t for d, glen, t in measured])))
        plans.append((lengths, plan))
        for d, glen, t in measured:
            refitter.observe(d, glen, t)
        new = refitter.refit() if refit else None
        if new is not None:
            assert new.token_capacity == WRONG.token_capacity and new.meta["refit"]["error_after"] < \
                new.meta["refit"]["error_before"]
            cost = new
        versions.append(refitter.version)
    return errors, plans, cost, versions


def test_refit_error_falls_below_bound_within_three_steps():
    errors, _, cost, versions = _closed_loop(refit=True)
    assert errors[0] > 0.4                                   # alpha1 x10: the first predictions are far off
    assert max(errors[WITHIN:]) < BOUND, errors
    assert versions[-1] >= 1
    assert cost.alpha1 == pytest.approx(TRUE.alpha1, rel=0.1)   # the wrong coefficient is found
    assert cost.token_capacity == TRUE.token_capacity
    without, *_ = _closed_loop(refit=False)
    assert min(without[WITHIN:]) > 0.3                       # without the refit the error stays


def test_refit_changes_plans_towards_the_true_models():
    _, plans, _, _ = _closed_loop(refit=True)
    later = plans[WITHIN:]
    wrong = [flexsp.plan_batch(lengths, WRONG, CLUSTER, strategy="greedy") for lengths, _ in later]
    true = [flexsp.plan_batch(lengths, TRUE, CLUSTER, strategy="greedy") for lengths, _ in later]
    changed = sum(p.degree_histogram() != w.degree_histogram() for (_, p), w in zip(later, wrong))
    assert changed >= len(later) // 2
    refit_time = sum(_true_time(p, lengths) for lengths, p in later)
    wrong_time = sum(_true_time(w, lengths) for (lengths, _), w in zip(later, wrong))
    true_time = sum(_true_time(t, lengths) for (lengths, _), t in zip(later, true))
    assert refit_time < wrong_time and refit_time == pytest.approx(true_time, rel=0.005)


def test_outliers_do_not_move_the_fit_and_unseen_degrees_stay():
    rng = np.random.default_rng(1)
    refitter = Refitter(WRONG, RefitConfig(min_points=4))
    for _ in range(40):      # degree 1 and 2 only, 10% of them 5x slow
        d = int(rng.choice([1, 2]))
        glen = list(rng.integers(500, 20000, 3))
        t = TRUE.group_time(glen, d) * (5 if rng.random() < 0.1 else 1)
        refitter.observe(d, glen, t)
    new = refitter.refit()
    assert new.alpha1 == pytest.approx(TRUE.alpha1, rel=0.05) and new.alpha2 == pytest.approx(TRUE.alpha2, rel=0.05)
    assert new.alltoall_bandwidth[8] == WRONG.alltoall_bandwidth[8]   # no degree-8 group measured: unchanged
    assert relative_error(new, refitter.observations) < 0.01


def test_no_refit_without_enough_points_or_gain():
    refitter = Refitter(TRUE, RefitConfig(min_points=8))
    for n in (1000, 2000, 3000):
        refitter.observe(1, [n], TRUE.group_time([n], 1))
    assert refitter.refit() is None                               # too few points
    for n in range(1000, 9000, 1000):
        refitter.observe(2, [n, n], TRUE.group_time([n, n], 2))
    assert refitter.refit() is None                               # the current model is already exact
    with pytest.raises(CostModelError):
        RefitConfig(window=0)


def test_a_windowed_model_refits_its_attention_as_one_ratio():
    """Window terms are part of the prediction and move with alpha1: measured 1.5x slower attention on a
    model with 512-token windows is recovered on both alpha1 and window_alpha."""
    true = dataclasses.replace(TRUE, window_alpha={512: TRUE.alpha1 * 3})
    wrong = dataclasses.replace(true, alpha1=true.alpha1 / 1.5, window_alpha={512: true.alpha1 * 3 / 1.5})
    refitter = Refitter(wrong, RefitConfig(min_points=4))
    rng = np.random.default_rng(2)
    for _ in range(30):
        d = int(rng.choice([1, 2]))
        glen = list(rng.integers(500, 30000, 3))
        refitter.observe(d, glen, true.group_time(glen, d))
    assert relative_error(wrong, refitter.observations) > 0.02
    new = refitter.refit()
    assert new.alpha1 == pytest.approx(true.alpha1, rel=0.02)
    assert new.window_alpha[512] == pytest.approx(true.window_alpha[512], rel=0.02)
    assert relative_error(new, refitter.observations) < 0.005
