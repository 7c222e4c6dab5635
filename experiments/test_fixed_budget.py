"""Known answers for the fixed-budget experiment's clock, rate choice and statistics (no model is run)."""
import math, os, statistics

import pytest

from experiments import fixed_budget as fb
from experiments import report_fixed_budget as rep


def run_rows(phase, arm, lr, seed, evals, attempt="a", end=True):
    """One run's rows as fixed_budget.Run writes them: a row per step, the held-out reward where given."""
    last = max(evals)
    return [{"phase": phase, "arm": arm, "lr": lr, "seed": seed, "attempt": attempt, "step": s,
             "clip": 0.1 * s, **({"eval_reward": evals[s]} if s in evals else {}), "end": end and s == last}
            for s in range(1, last + 1)]


def tuned(arm, scores_by_lr, seeds=fb.SEEDS["tune"]):
    """Rows of a finished tuning phase for one arm: {lr: (score at 32, score at 64)}, the same on every seed
    but for a small seed-dependent wobble that averages out."""
    rows = []
    for lr, (at32, at64) in scores_by_lr.items():
        for i, seed in enumerate(seeds):
            wobble = (i - (len(seeds) - 1) / 2) * 0.01
            rows += run_rows("tune", arm, lr, seed, {fb.steps_for(arm, 32): at32 + wobble,
                                                     fb.steps_for(arm, 64): at64 + wobble})
    return rows


def test_a_budget_is_spent_after_mu_times_its_steps_and_at_S_4_after_as_many_as_mu_1():
    assert [fb.steps_for("μ=1", b) for b in (32, 64)] == [4, 8]
    assert [fb.steps_for("μ=2", b) for b in (32, 64)] == [8, 16]
    assert [fb.steps_for("μ=4", b) for b in (32, 64)] == [16, 32]
    assert [fb.steps_for("S=4", b) for b in (32, 64)] == [4, 8]  # one batch of 32 serves 4 steps, once each
    with pytest.raises(ValueError, match="not a whole number of S=4's generation batches of 32"):
        fb.steps_for("S=4", 48)


def test_a_constant_rate_run_is_read_at_each_budgets_step():
    rows = run_rows("tune", "μ=4", 1e-4, 42, {8: -50.0, 16: -30.0, 24: -25.0, 32: -20.0})
    assert fb.budget_scores(rows, "μ=4") == {32: -30.0, 64: -20.0}  # steps 16 and 32, not 8 or 24
    assert fb.budget_scores(rows[:20], "μ=4") == {32: -30.0}  # cut short: the budget it reached


def test_only_the_attempt_that_ended_counts():
    cut = run_rows("tune", "μ=1", 1e-4, 42, {4: -99.0, 8: -99.0}, attempt="x", end=False)[:5]
    whole = run_rows("tune", "μ=1", 1e-4, 42, {4: -40.0, 8: -30.0}, attempt="y")
    expected = {("μ=1", 32): {1e-4: {42: -40.0}}, ("μ=1", 64): {1e-4: {42: -30.0}}}
    assert fb.scores(cut + whole, "tune") == expected
    assert fb.scores(cut, "tune") == {}


def test_each_budget_chooses_its_own_best_rate_by_the_mean_over_seeds():
    rows = tuned("μ=1", {4e-5: (-40, -25), 8e-5: (-35, -20), 1.6e-4: (-30, -24), 3.2e-4: (-33, -40)})
    chosen = fb.choose_rates(fb.scores(rows, "tune"), fb.SEEDS["tune"])
    assert chosen[("μ=1", 32)] == (1.6e-4, True) and chosen[("μ=1", 64)] == (8e-5, True)
    at_edge = fb.choose_rates(fb.scores(tuned("μ=2", {4e-5: (-40, -30), 8e-5: (-30, -20)}), "tune"),
                              fb.SEEDS["tune"])
    assert at_edge[("μ=2", 32)] == (8e-5, False)  # the top of its grid: not inside
    missing = tuned("μ=4", {4e-5: (-40, -30), 8e-5: (-10, -10), 1.6e-4: (-30, -20)}, seeds=[42, 43])
    assert fb.choose_rates(fb.scores(missing, "tune"), fb.SEEDS["tune"]) == {}  # 2 of 6 seeds: no choice


def test_the_grid_grows_a_factor_2_past_the_edge_where_a_best_lies_until_both_are_inside():
    assert fb.tuning_grid("μ=1", []) == list(fb.GRID)
    rows = tuned("μ=1", {4e-5: (-40, -25), 8e-5: (-35, -26), 1.6e-4: (-30, -27)})  # 32 at its top, 64 bottom
    assert fb.tuning_grid("μ=1", rows) == [2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4]
    rows += tuned("μ=1", {2e-5: (-50, -30), 3.2e-4: (-45, -40)})  # both now inside
    assert fb.tuning_grid("μ=1", rows) == [2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4]
    assert fb.final_rates(rows) == {("μ=1", 32): 1.6e-4, ("μ=1", 64): 4e-5}
    confirm = fb.tasks("confirm", rows)
    assert {t[:2] for t in confirm} == {("μ=1", 1.6e-4), ("μ=1", 4e-5)}  # one run per chosen rate
    assert {t[3] for t in confirm if t[1] == 1.6e-4} == {4} and {t[3] for t in confirm if t[1] == 4e-5} == {8}
    assert sorted({t[2] for t in confirm}) == list(fb.SEEDS["confirm"])  # fresh seeds, disjoint from tuning
    assert not set(fb.SEEDS["confirm"]) & set(fb.SEEDS["tune"]) and len(fb.SEEDS["confirm"]) >= 12


@pytest.mark.parametrize("p, df, expected", [(0.975, 1, 12.7062), (0.975, 11, 2.20099), (0.975, 30, 2.04227),
                                             (0.95, 5, 2.01505)])
def test_t_quantiles_match_the_tables(p, df, expected):
    assert rep.t_quantile(p, df) == pytest.approx(expected, abs=2e-4)


def test_a_t_interval_and_a_paired_one():
    mean, low, high, n = rep.t_interval([1.0, 2.0, 3.0, 4.0])
    half = 3.182446 * math.sqrt(5 / 3) / 2  # t(0.975, 3) × sd / √n
    assert (mean, n) == (2.5, 4)
    assert (low, high) == (pytest.approx(2.5 - half, abs=1e-4), pytest.approx(2.5 + half, abs=1e-4))
    a, b = {1: 5.0, 2: 7.0, 3: 9.0, 9: 100.0}, {1: 4.0, 2: 5.0, 3: 6.0}  # seed 9 has no pair: left out
    assert rep.paired(a, b)[0] == pytest.approx(2.0) and rep.paired(a, b)[3] == 3
    with pytest.raises(ValueError, match="two values or more"):
        rep.t_interval([1.0])


def test_seconds_to_spend_a_budget():
    cost = dict(g=0.4, l=0.1, r_4=2.0)
    assert rep.seconds_to_spend("μ=1", 64, **cost) == pytest.approx(8.0)  # 8 steps of one T1 each
    assert rep.seconds_to_spend("μ=4", 32, **cost) == pytest.approx(4 * (0.4 + 0.1 + 4 * 0.6))
    assert rep.seconds_to_spend("S=4", 32, **cost) == pytest.approx(0.4 * 2 + 4 * 0.1 + 4 * 0.6)


def test_clip_fractions_count_the_off_policy_steps_only():
    runs = {("confirm", "μ=2", 1e-4, 100): run_rows("confirm", "μ=2", 1e-4, 100, {8: -1.0})}
    assert rep.clip_fractions(runs) == {"μ=2": pytest.approx(statistics.mean([0.2, 0.4, 0.6, 0.8]))}


def test_a_worker_stops_when_every_run_is_done_even_those_a_live_worker_claimed(tmp_path, monkeypatch):
    """The claims of a live worker's finished runs are no reason to wait: with nothing left, None."""
    monkeypatch.setattr(fb, "tasks", lambda phase, rows: [("μ=1", 1e-4, 42, 8)])
    rows_path, claims_path = str(tmp_path / "rows.jsonl"), str(tmp_path / "claims.jsonl")
    fb.append(claims_path, {"phase": "tune", "arm": "μ=1", "lr": 1e-4, "seed": 42, "pid": os.getpid()})
    assert fb.claim_next(["tune"], rows_path, claims_path) == "wait"  # claimed by a live worker, unfinished
    for row in run_rows("tune", "μ=1", 1e-4, 42, {4: -40.0, 8: -30.0}):
        fb.append(rows_path, row)
    assert fb.claim_next(["tune"], rows_path, claims_path) is None  # finished: nothing to wait for
