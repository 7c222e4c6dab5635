"""The statistics behind docs/update-clock/table.md and its verdict, on hand-made curves with
known answers: uneven points, ties, noise, a run that never ends, a target that is never reached."""
import numpy as np
import pytest

from experiments import report_update_clock as r
from experiments import update_clock

BASE = {0: -60.0, 4: -50.0, 8: -40.0, 12: -30.0, 16: -20.0}  # μ = 1: +2.5 reward per step


def test_a_curve_is_read_linearly_between_uneven_points():
    curve = {0: -60.0, 2: -40.0, 10: -20.0}
    assert (r.reward_at(curve, 1) == -50.0 and r.reward_at(curve, 6) == -30.0
            and r.reward_at(curve, 10) == -20.0)


@pytest.mark.parametrize("curve,y,x", [
    (BASE, -30.0, 12.0), (BASE, -45.0, 6.0), (BASE, -60.0, 0.0), (BASE, -70.0, 0.0),
    (BASE, -10.0, None),                                            # never reached
    ({0: -60.0, 4: -40.0, 8: -40.0, 12: -20.0}, -40.0, 4.0),        # a tie: the first step that reaches it
    ({0: -60.0, 4: -30.0, 8: -50.0, 12: -20.0}, -40.0, 4 * 20 / 30),  # noisy: the first crossing
])
def test_the_first_crossing(curve, y, x):
    assert (r.first_crossing(curve, y) == pytest.approx(x) if x is not None
            else r.first_crossing(curve, y) is None)


@pytest.mark.parametrize("reward,w", [
    (-40.0, (8 - 4) / (16 - 4)),  # μ = 4's 16 steps reach μ = 1's step 8: 4 fresh steps + 12 worth 1/3 each
    (-20.0, 1.0),                 # as far as 16 fresh steps: a reuse step is worth a fresh one
    (-50.0, 0.0),                 # as far as its 4 fresh steps alone: the reuse steps were worth nothing
    (-55.0, -1 / 6),              # less: they hurt
    (-15.0, np.inf),              # beyond where μ = 1 got: censored
])
def test_the_worth_of_an_off_policy_step_in_fresh_steps(reward, w):
    assert r.worth(BASE, reward, 16, fresh=4) == pytest.approx(w)


def seeds(*offsets):  # one run per seed: the base curve shifted by its offset
    return {s: {k: v + o for k, v in BASE.items()} for s, o in enumerate(offsets)}


def test_the_bootstrap_pairs_the_seeds_so_that_a_constant_gain_has_no_spread():
    """Seed noise (±10) is shared by both arms; the arm is 5 better on every seed: its difference is exactly
    5, while each arm's own mean still has the seeds' spread."""
    rng = np.random.default_rng(0)
    base, arm = seeds(-10, 0, 10, -5, 5, 0), seeds(-5, 5, 15, 0, 10, 5)
    diff = r.bootstrap({"base": base, "arm": arm}, lambda m: m["arm"][16] - m["base"][16], rng)
    assert diff[:3] == pytest.approx((5.0, 5.0, 5.0), abs=1e-12) and diff[3] == 6
    mean, low, high, n = r.bootstrap({"base": base}, lambda m: m["base"][16], rng)
    assert mean == -20.0 and -30 <= low < -20 < high <= -10 and n == 6


def test_the_bootstrap_interval_of_a_mean_covers_it_and_stays_inside_the_seeds_range():
    rng = np.random.default_rng(1)
    data = seeds(-3, 8, 1, -6, 4, 2, -1, 7)
    mean, low, high, _ = r.bootstrap({"a": data}, lambda m: m["a"][8], rng)
    assert mean == pytest.approx(-40 + 12 / 8) and -46 <= low < mean < high <= -32


def rows_of(arm, lr, seed, rewards, end=True):
    return [{"arm": arm, "lr": lr, "seed": seed, "step": k, "eval_reward": v, "clip": 0.0,
             "end": end and k == max(rewards)} for k, v in rewards.items()]


def test_only_runs_that_ended_count_and_each_starts_at_the_untrained_reward():
    start = [{"arm": None, "lr": None, "seed": None, "step": 0, "eval_reward": -60.0, "end": False}]
    rows = (start + rows_of("μ=1", 1e-5, 42, {4: -50.0, 8: -40.0})
            + rows_of("μ=1", 1e-5, 43, {4: -1.0}, end=False))
    assert dict(r.curves(rows)) == {("μ=1", 1e-5): {42: {0: -60.0, 4: -50.0, 8: -40.0}}}


def test_the_best_rate_and_whether_the_grid_brackets_it():
    data = {("μ=1", lr): seeds(0) if lr == 2e-5 else seeds(-10) for lr in (1e-5, 2e-5, 4e-5)}
    data.update({("μ=4", lr): seeds(lr * 1e5) for lr in (1e-5, 2e-5, 4e-5)})  # best at the top: extend
    best = r.best_rates(data)
    assert (best["μ=1"]["lr"], best["μ=1"]["inside"]) == (2e-5, True)
    assert (best["μ=4"]["lr"], best["μ=4"]["inside"]) == (4e-5, False)
    assert best["μ=4"]["final"][1e-5] == pytest.approx(-19.0)


def test_a_run_cut_short_and_run_again_counts_once_with_its_last_attempt():
    start = [{"arm": None, "lr": None, "seed": None, "step": 0, "eval_reward": -60.0, "end": False}]
    cut = rows_of("μ=2", 2e-5, 42, {1: -99.0, 2: -99.0}, end=False)
    again = rows_of("μ=2", 2e-5, 42, {1: -55.0, 2: -50.0})
    assert r.curves(start + cut + again)["μ=2", 2e-5][42] == {0: -60.0, 1: -55.0, 2: -50.0}


def test_a_rate_with_fewer_seeds_than_the_grid_is_shown_but_does_not_compete():
    data = {("μ=1", 1e-5): seeds(0, 0, 0), ("μ=1", 2e-5): seeds(-5, -5, -5), ("μ=1", 4e-5): seeds(-9, -9, -9),
            ("μ=1", 5e-6): seeds(30)}  # best by far, but one seed: a pilot
    best = r.best_rates(data)["μ=1"]
    assert best["lr"] == 1e-5 and not best["inside"] and 5e-6 not in best["final"]


def test_a_missing_or_empty_rows_file_is_named(tmp_path):
    for content in (None, ""):
        path = tmp_path / "rows.jsonl"
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit, match="no rows file|holds no finished run"):
            r.read(str(path))


@pytest.mark.parametrize("argv, message", [(["--seeds", "0"], "--seeds must be >= 1"),
                                           (["--workers", "0"], "--workers must be >= 1"),
                                           (["--eval-every", "0"], "--eval-every must be >= 1"),
                                           (["--max-steps", "0"], "--max-steps must be >= 1"),
                                           (["--worker", "3", "--workers", "2"], "--worker must lie in")])
def test_update_clock_refuses_flags_that_would_run_nothing_or_divide_by_zero(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        update_clock.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
