"""Tests of the lab (experiments/lab.py, experiments/benchmark.py): the statistics on hand-made curves with
known answers, and the grid, the budgets, the resume and the benchmark end to end on the tiny model of
test_train_tldr.py, whose fixtures and helpers these tests share. About 40 s on 2 cores."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from experiments import benchmark, lab
from experiments.metric_names import clip_fraction, metric
from test_train_tldr import args, interrupted_in_run, is_png, metrics
from test_train_tldr import one_thread, tiny  # noqa: F401 (fixtures: one thread, the tiny model)

HERE = os.path.dirname(os.path.abspath(__file__))


def tables(md_file):
    """[{header: [the rows' cells]}] for each markdown table in md_file, in order."""
    found, lines = [], open(md_file).read().splitlines() + [""]
    rows = []
    for line in lines:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            found.append({h: [row[i] for row in rows[2:]] for i, h in enumerate(rows[0])})
            rows = []
    return found


def table_columns(md_file):  # the first table
    return tables(md_file)[0]


def sweep_points(folder):
    with open(os.path.join(folder, "sweep.jsonl")) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------------
# The statistics, on hand-made runs: {"mu", "points": [{"step", "elapsed", "generated", "reward", ...}]}
# ----------------------------------------------------------------------------------------------------
def run_of(steps, rewards, mu=1, elapsed=None, generated=None, **columns):
    """A run's points at these optimizer steps (elapsed: one second a step unless given)."""
    elapsed = elapsed or [float(s) for s in steps]
    generated = generated or [True] * len(steps)
    return {"mu": mu, "points": [{"step": s, "elapsed": e, "generated": g, "reward": r,
                                  "generated_completions": 16 * s, **{k: v[i] for k, v in columns.items()}}
                                 for i, (s, e, g, r) in enumerate(zip(steps, elapsed, generated, rewards))]}


def test_reward_by_averages_the_generation_batches_of_the_budget_s_last_third():
    rewards = [-60, -50, -40, -30, -20, -10, 0, 10, 20]
    run = run_of(range(1, 10), rewards)
    assert lab.reward_by(run, "elapsed", 9) == 10         # seconds 7, 8, 9 (6 = 2·9/3 is out: an open third)
    assert lab.reward_by(run, "elapsed", 7.5) == -5       # seconds 6, 7 of (5, 7.5]
    noisy = run_of(range(1, 10), [r + 5 * (-1) ** i for i, r in enumerate(rewards)])
    assert lab.reward_by(noisy, "elapsed", 9) == pytest.approx((5 + 5 + 25) / 3)  # 0 + 5, 10 - 5, 20 + 5
    # uneven logging: no batch in (8, 12] but the one at 9.5; none in (2.93, 4.4]: the newest before, at 2
    uneven = run_of([1, 2, 5, 9, 13], [-60, -55, -40, -20, 0], elapsed=[1, 2, 5, 9.5, 13])
    assert lab.reward_by(uneven, "elapsed", 12) == -20
    assert lab.reward_by(uneven, "elapsed", 4.4) == -55
    assert lab.reward_by(uneven, "elapsed", 0.5) == -60    # before its first batch: the first one
    # reuse steps carry the last batch's reward; they are no measurement and do not count
    reuse = run_of([1, 2, 3, 4], [-40, -40, -20, -20], mu=2, generated=[True, False, True, False])
    assert lab.reward_by(reuse, "elapsed", 4) == -20      # the batch at 3 alone, not with step 4's copy


def test_reward_by_on_completions():
    run = run_of(range(1, 7), [-60, -50, -40, -30, -20, -10])  # 16 completions per step: 16, 32, ... 96
    assert lab.reward_by(run, "generated_completions", 96) == -15  # 80 and 96 in (64, 96]
    assert lab.reward_by(run, "generated_completions", 40) == -50  # 32 in (26.7, 40]


def test_steps_to_reach_reads_the_mean_curve_between_batches():
    line = [run_of(range(1, 11), [-50 + 5 * u for u in range(10)])]
    assert lab.steps_to_reach(line, -30, 10) == 5          # exactly at a batch
    assert lab.steps_to_reach(line, -32, 10) == pytest.approx(4.6)  # between steps 4 (-35) and 5 (-30)
    assert lab.steps_to_reach(line, 0, 10) is None         # never reached: -5 at step 10
    assert lab.steps_to_reach(line, -10, 8) is None        # reached at step 9, after `last`
    # two seeds with noise, μ = 2 (batches at steps 1, 3, 5): the mean of the lines joining their batches
    seeds = [run_of([1, 3, 5], [-50, -40, -30], mu=2), run_of([1, 3, 5], [-54, -38, -34], mu=2)]
    assert lab.reward_after(seeds, 2) == pytest.approx(-45.5) and lab.reward_after(seeds, 4) == -35.5
    assert lab.steps_to_reach(seeds, -36, 5) == pytest.approx(4 - 0.5 / 3.5)
    # ties: a flat start already at the target is reached at once; a plateau is crossed where it ends
    assert lab.steps_to_reach([run_of([1, 2, 3], [-30, -30, -20])], -30, 3) == 2
    plateau = [run_of([1, 2, 3, 4], [-50, -40, -40, -30])]
    assert lab.steps_to_reach(plateau, -40, 4) == 2
    assert lab.steps_to_reach(plateau, -35, 4) == pytest.approx(3.5)


def test_cost_shares_weigh_each_point_by_the_steps_it_averages():
    """logging_steps 2 and a last log after 1 step: each point's time_* is the mean over the steps since the
    point before. g: generation (and time_logps) over all seconds of all μ = 1 runs; l: their forward."""
    a = run_of([2, 4, 5], [0, 0, 0], elapsed=[20, 40, 50], time_generate=[4, 4, 6], time_logps=[0.5, 0.5, 0],
               time_forward=[3, 3, 2])
    b = run_of([3], [0], elapsed=[30], time_generate=[5], time_logps=[1], time_forward=[2])
    assert lab.phase_seconds(a["points"], "generate") == 22  # 4 × 2 + 4 × 2 + 6 × 1
    assert lab.phase_seconds(a["points"], "forward") == 14
    assert lab.cost_shares([a, b]) == (pytest.approx(42 / 80), pytest.approx(20 / 80))


def test_mean_band_over_seeds_on_the_grid_where_every_seed_has_data():
    same = [([0, 1, 2], [0, 2, 4]), ([0, 1, 2], [2, 2, 2])]
    grid, mean, low, high = lab.mean_band([tuple(map(np.array, s)) for s in same])
    assert grid.tolist() == [0, 1, 2] and mean.tolist() == [1, 2, 3] and low.tolist() == [0, 2, 2]
    assert high.tolist() == [2, 2, 4]
    # uneven: one seed logs at 0, 2, 4, the other at 1, 3 (joins late, ends early): the overlap, interpolated
    grid, mean, low, high = lab.mean_band([(np.array([0, 2, 4]), np.array([0, 4, 8])),
                                           (np.array([1, 3]), np.array([10, 10]))])
    assert grid.tolist() == [1, 2, 3] and mean.tolist() == [6, 7, 8] and low.tolist() == [2, 4, 6]
    assert high.tolist() == [10, 10, 10]
    # ties: both seeds at the same x count once on the grid
    grid, mean, _, _ = lab.mean_band([(np.array([0, 2]), np.array([0, 2])),
                                      (np.array([0, 2]), np.array([4, 6]))])
    assert grid.tolist() == [0, 2] and mean.tolist() == [2, 4]
    # no overlap at all: each x averages the seeds that cover it
    grid, mean, low, high = lab.mean_band([(np.array([0, 1]), np.array([0, 1])),
                                           (np.array([2, 3]), np.array([5, 7]))])
    assert grid.tolist() == [0, 1, 2, 3] and mean.tolist() == [0, 1, 5, 7] and low.tolist() == high.tolist()


def test_first_reaching_reads_the_mean_of_the_last_three_batches():
    run = run_of(range(1, 7), [-40, -20, -30, -10, -12, -50], generated=[True, True, False, True, True, True])
    assert lab.first_reaching(run["points"], -20) == run["points"][4]  # -20, -10, -12: step 5's the third
    assert lab.first_reaching(run["points"], -5) is None           # never
    assert lab.recent_reward(run["points"]) == pytest.approx(-24)  # -10, -12, -50


def linear_runs(mu, reward, steps=range(1, 25)):  # two seeds alike, one step a second
    run = run_of(steps, [reward(s - 1) for s in steps], mu=mu, generated=[(s - 1) % mu == 0 for s in steps])
    return [run, run]


@pytest.mark.parametrize("mu", [2, 4])
def test_the_worth_of_a_reuse_step_and_where_mu_pays_come_back_from_known_curves(mu):
    """μ = 1 gains 4 reward per step, one step a second. μ's steps on fresh batches gain 4 too, its reuse
    steps 4w: w comes back, and with l = 0.1 the generation share above which μ wins per second,
    1 - w + l/(μ - 1)."""
    base = linear_runs(1, lambda u: -60 + 4 * u)
    for w in (0.25, 0.5, 1.0):
        found_w, g_star = lab.where_mu_pays(linear_runs(mu, lambda u: -60 + 4 * (u / mu + w * (u - u / mu))),
                                            base, (0.5, 0.1), 12.0)
        assert abs(found_w - w) < 0.05 and abs(g_star - (1 - found_w + 0.1 / (mu - 1))) < 1e-9
    flat = linear_runs(1, lambda u: -60.0 + 5 * (-1) ** u)  # μ = 1 learns nothing: nothing to measure against
    assert lab.where_mu_pays(linear_runs(mu, lambda u: -60.0 + u), flat, (0.5, 0.1), 12.0) is None


def test_where_mu_pays_with_noise_uneven_logging_and_a_run_that_never_gets_there():
    """μ = 1's curve reaches half its gain by 12 s (-60 to -22: -41) after u1 = 4.75 updates."""
    base = linear_runs(1, lambda u: -60 + 4 * u)
    pays = lambda runs, base: lab.where_mu_pays(runs, base, (0.5, 0.1), 12.0)
    mu2 = linear_runs(2, lambda u: -60 + 3 * u)  # μ = 2 gaining 3 a step: w = 0.5
    w, g_star = pays(mu2, base)
    assert w == pytest.approx(0.5, abs=0.05) and g_star == pytest.approx(1 - w + 0.1)
    # noise that cancels between the two seeds: the mean curve, so w, is the same
    noisy = [run_of(range(1, 25), [-60 + 4 * u + sign * 3 * (-1) ** u for u in range(24)])
             for sign in (1, -1)]
    assert pays(mu2, noisy) == pytest.approx((w, g_star))
    # μ = 1 logged at uneven steps: its batches at 9 and 12 still average -22 by 12 s, its line is the same
    uneven = linear_runs(1, lambda u: -60 + 4 * u, steps=[1, 2, 4, 5, 7, 9, 12, 16, 20, 24])
    assert pays(mu2, uneven) == pytest.approx((w, g_star))
    # μ = 2 never leaves -60 in its 24 steps: bounds from its last update, u = 23
    w, g_star = (4.75 - 23 / 2) / (23 * 0.5), (1 + 0.1 / 2 - 4.75 / 23) / 0.5
    assert pays(linear_runs(2, lambda u: -60.0), base) == (f"< {w:.2f}", f"> {g_star:.2f}")


def test_mean_sd_and_spread():
    assert lab.mean_sd([]) == "-" and lab.mean_sd([-12.34]) == "-12.3"
    assert lab.mean_sd([-10, -14]) == "-12 ± 2.8"
    assert lab.spread([12, 12]) == "12" and lab.spread([9, 12, 10]) == "9-12"


# ----------------------------------------------------------------------------------------------------
# The lab's runs, on the tiny model
# ----------------------------------------------------------------------------------------------------
def test_seeded_sweep_logs_every_point_on_three_clocks_and_predicts_the_step_cost(tiny, tmp_path):
    argv = args(tiny, tmp_path / "sweep", "--sweep", "1", "2", "--seeds", "2", "--max_steps", "4")
    assert lab.main(argv) == 0
    folder = tmp_path / "sweep" / "mu=1,2-seeds=42-43"
    points = sweep_points(folder)
    keys = {"mu", "seed", "step", "generated_completions", "elapsed", "reward", "step_seconds"}
    assert len(points) == 16 and all(keys <= p.keys() and clip_fraction(p) >= 0 for p in points)
    run = lambda mu, seed: [p for p in points if (p["mu"], p["seed"]) == (mu, seed)]
    for mu in (1, 2):
        for seed in (42, 43):  # the same seeds for every μ, each run in a folder of its own
            assert [p["step"] for p in run(mu, seed)] == [r["step"] for r in metrics(
                tmp_path / "sweep" / f"mu={mu}-seed={seed}")] == [1, 2, 3, 4]
    # 8 completions per generation batch (2 prompts × 4), generated at steps 1 and 3 with μ = 2
    assert [p["generated_completions"] for p in run(2, 43)] == [8, 8, 16, 16]
    assert [p["generated_completions"] for p in run(1, 42)] == [8, 16, 24, 32]
    assert run(2, 42)[1]["reward"] == run(2, 42)[0]["reward"]  # carried over the reuse step
    assert is_png(folder / "rewards.png")
    columns = table_columns(folder / "rewards.md")
    assert columns["μ"] == ["1", "2"] and columns["seeds"] == ["2", "2"]
    measured, predicted = columns["T(μ)/T(1) measured"], columns["T(μ)/T(1) predicted"]
    assert measured[0] == predicted[0] == "1" and float(measured[1]) > 0 and 0.5 < float(predicted[1]) < 2
    assert "±" in columns["final reward (mean of last 3 logged)"][0]
    clips = columns["clip fraction, reuse steps"]
    assert clips[0] == "—" and float(clips[1]) >= 0


def test_target_reward_stops_once_the_recent_mean_reaches_it(tiny, tmp_path, capsys):
    assert lab.main(args(tiny, tmp_path / "run", "--max_steps", "20", "--target-reward=-1e9")) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]  # the first full window of 3 logs
    assert "target reward -1e+09 reached at step 3" in capsys.readouterr().out
    assert "time to target (median s)" in table_columns(tmp_path / "run" / "rewards.md")


def test_time_budget_stops_a_run(tiny, tmp_path):
    assert lab.main(args(tiny, tmp_path / "run", "--max_steps", "20", "--time-budget", "0.001")) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]


def without_clocks(points):  # what a resumed run repeats exactly: not its clocks, nor its peak memory
    measured = ("elapsed", "step_seconds", "peak_rss_gib")
    return [{k: v for k, v in p.items() if not k.startswith("time_") and k not in measured} for p in points]


def test_resume_finishes_a_sweep_cut_short(tiny, tmp_path, monkeypatch):
    """Ctrl-C in μ = 2's third generation batch (step 5): μ = 1 is finished, μ = 2 has checkpoint-4, μ = 4
    never started. --resume keeps μ = 1, continues μ = 2 from step 4, starts μ = 4: every step once in
    sweep.jsonl, points (clocks aside) as those of a sweep never cut, its clock going on across the resume."""
    sweep = ["--sweep", "1", "2", "4", "--max_steps", "8", "--save_steps", "2", "--seeds", "1"]
    assert lab.main(args(tiny, tmp_path / "whole", *sweep)) == 0
    interrupted_in_run(monkeypatch, mu=2, generation_batch=3)
    assert lab.main(args(tiny, tmp_path / "cut", *sweep)) == 130
    cut = sweep_points(tmp_path / "cut" / "mu=1,2,4")
    expected = [(1, s) for s in range(1, 9)] + [(2, s) for s in range(1, 5)]  # μ = 4 never started
    assert [(p["mu"], p["step"]) for p in cut] == expected
    monkeypatch.undo()
    assert lab.main(args(tiny, tmp_path / "cut", *sweep, "--resume")) == 0
    points = sweep_points(tmp_path / "cut" / "mu=1,2,4")
    assert sorted((p["mu"], p["step"]) for p in points) == [(mu, s) for mu in (1, 2, 4) for s in range(1, 9)]
    assert points[:8] == cut[:8]  # μ = 1, finished, stays as it was
    key = lambda p: (p["mu"], p["step"])
    whole = sweep_points(tmp_path / "whole" / "mu=1,2,4")
    assert without_clocks(sorted(points, key=key)) == without_clocks(sorted(whole, key=key))
    mu2 = [p["elapsed"] for p in sorted(points, key=key) if p["mu"] == 2]
    assert mu2 == sorted(mu2)
    assert table_columns(tmp_path / "cut" / "mu=1,2,4" / "rewards.md")["μ"] == ["1", "2", "4"]
    assert lab.main(args(tiny, tmp_path / "cut", *sweep, "--resume")) == 0  # all finished: a report
    assert sweep_points(tmp_path / "cut" / "mu=1,2,4") == points


def test_a_grid_of_mu_and_learning_rates_reports_every_cell(tiny, tmp_path):
    """--lrs: every μ at every learning rate (and seed), each run in a folder of its own, lr on each point."""
    argv = args(tiny, tmp_path / "grid", "--sweep", "1", "2", "--lrs", "1e-3", "4e-3", "--seeds", "2",
                "--max_steps", "3")
    assert lab.main(argv) == 0
    folder = tmp_path / "grid" / "mu=1,2-lrs=0.001,0.004-seeds=42-43"
    points = sweep_points(folder)
    assert sorted({(p["mu"], p["lr"], p["seed"]) for p in points}) == [
        (mu, lr, seed) for mu in (1, 2) for lr in (1e-3, 4e-3) for seed in (42, 43)]
    assert all(len(metrics(tmp_path / "grid" / f"mu={mu}-lr={lr}-seed={seed}")) == 3
               for mu in (1, 2) for lr in ("0.001", "0.004") for seed in (42, 43))
    columns = table_columns(folder / "rewards.md")
    assert list(zip(columns["learning rate"], columns["μ"])) == [
        ("0.001", "1"), ("0.001", "2"), ("0.004", "1"), ("0.004", "2")]
    assert columns["reuse step worth w"][0] == "—"  # μ = 1: no reuse step
    assert is_png(folder / "rewards.png")


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--lrs", "1e-5", "1e-5"], "--lrs values must differ"),
    (["--lrs", "0"], "--lrs values must be > 0"),
    (["--time-budget", "0"], "--time-budget must be > 0"),
    (["--seeds", "2", "--resume", "/some/checkpoint-4"], "a sweep resumes with --resume alone"),
    (["--sweep", "0"], "--sweep values must be >= 1"),  # the demo's checks hold here too
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        lab.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------
def test_the_cost_model_from_known_rows(monkeypatch, tmp_path):
    """g = 0.6, l = 0.15, r_4 = 2: T(2, 1) = 0.4 + 0.75/2, T(4, 1) = 0.4 + 0.75/4,
    T(1, 4) = 0.4 + (1.2 + 0.6)/4; w*(2) = 0.4 + 0.15, w*(4) = 0.4 + 0.05, w*_4 = (1.6 + 1.2 + 0.6 - 1)/3."""
    row = lambda name, generate, logps, total: {"configuration": name, "generate": generate, "logps": logps,
                                                "total": total}
    rows = [row("μ=1 β=0 fp32", 6.0, 0.0, 10.0), row("μ=4 β=0 fp32 generation step", 6.0, 1.5, 14.0),
            row("μ=4 β=0 fp32 per step over a cycle", 1.5, 0.4, 6.0),
            row("μ=1 S=4 β=0 fp32 generation step", 12.0, 6.0, 30.0),
            row("μ=1 S=4 β=0 fp32 per step over a cycle", 3.0, 1.5, 7.5)]
    config, _ = benchmark.parse_args([])
    monkeypatch.setattr(benchmark, "SUMMARY", str(tmp_path / "summary.json"))
    text = benchmark.cost_model(rows, config)
    assert "g = 0.600" in text and "l = 0.150" in text and "r_4 = 2.000" in text
    assert "93.8 ms per token for one generation batch (32 completions), 188 ms for one 4× larger" in text
    arms = tables_of(text)
    assert arms["arm"] == ["μ=2", "μ=4", "S=4"]
    assert arms["T(μ, S)/T(1, 1) predicted"] == ["0.775", "0.588", "0.850"]
    assert arms["measured"] == ["—", "0.600", "0.750"]
    assert arms["break-even worth w*"] == ["0.550", "0.450", "0.800"]
    assert "summary.json does not exist yet: no measured worth to set beside w*." in text
    (tmp_path / "summary.json").write_text(json.dumps({"setting": "SmolLM2-135M, 16 steps", "w": {
        "μ=2": [0.1, -0.2, 0.4], "μ=4": [0.5, 0.46, 0.7], "S=4": [0.9, 0.6, 1.1]}}))
    text = benchmark.cost_model(rows, config)
    arms = tables_of(text)
    assert arms["measured worth w [interval]"] == ["0.10 [-0.20, 0.40]", "0.50 [0.46, 0.70]",
                                                   "0.90 [0.60, 1.10]"]
    assert arms["here"] == ["does not pay", "pays", "undecided"] and "SmolLM2-135M, 16 steps" in text
    (tmp_path / "summary.json").write_text(json.dumps({"setting": "x", "w": {"μ=4": [None, 0.5, None]}}))
    arms = tables_of(benchmark.cost_model(rows, config))  # bounds not finite: the finite one decides
    assert arms["measured worth w [interval]"] == ["—", "> 1 [0.50, > 1]", "—"] and arms["here"][1] == "pays"
    assert "need the μ = 1, μ = 4 and S = 4" in benchmark.cost_model(rows[1:], config)


def tables_of(text):
    lines = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[:1] + lines[2:]]
    return {h: [row[i] for row in cells[1:]] for i, h in enumerate(cells[0])}


def test_phase_rows_split_generation_and_reuse_steps():
    step = lambda elapsed, gen: {"elapsed": elapsed, "time_generate": gen, "time_logps": gen / 2,
                                 "time_forward": 1.0, "time_backward": 2.0, "time_optimizer": 0.5,
                                 "peak_rss_gib": 1.5}
    records = [step(10.0, 4.0), step(14.0, 0.0), step(24.0, 4.0), step(28.0, 0.0)]  # μ=2: gen, reuse, ...
    gen, reuse, cycle = benchmark.phase_rows("x", records, mu=2)
    assert (gen["steps"], gen["total"], gen["generate"], gen["other"]) == (2, 10.0, 4.0, 0.5)
    assert (reuse["steps"], reuse["total"], reuse["logps"], reuse["other"]) == (2, 4.0, 0.0, 0.5)
    assert cycle["total"] == 7.0 and cycle["other %"] == pytest.approx(100 * 0.5 / 7)
    assert gen["peak RSS GiB"] == 1.5
    labels = [r["configuration"] for r in benchmark.phase_rows("x", records, mu=1, s=2)]  # S=2: one cycle
    assert labels == ["x generation step", "x later mini-batch steps", "x per step over a cycle"]


def test_the_benchmark_measures_each_arm_in_a_fresh_process_and_its_formulas_match_its_table(
        tiny, tmp_path, monkeypatch, capsys):
    """μ = 1, μ = 4 and S = 4 at β = 0, a child process each, with fixed-length decoding; the cost model that
    it prints is the formulas applied to the table that it writes."""
    monkeypatch.setattr(benchmark, "CONFIGURATIONS", [(1, 1, 0.0), (4, 1, 0.0), (1, 4, 0.0)])
    monkeypatch.setattr(benchmark, "SUMMARY", str(tmp_path / "no-summary.json"))
    argv = args(tiny, tmp_path / "bench-μ={mu}", "--benchmark-steps", "1")
    assert benchmark.main(argv) == 0
    folder = tmp_path / "bench-μ=1,4-benchmark"
    for name, steps in (("μ=1-β=0-fp32", [1]), ("μ=4-β=0-fp32", [1, 2, 3, 4]),
                        ("μ=1-S=4-β=0-fp32", [1, 2, 3, 4])):
        records = metrics(folder / name)
        assert [r["step"] for r in records] == steps  # 1 step rounded up to a whole cycle of μ·S steps
        assert metric(records[0], "completions/mean_length") == 8  # fixed length: no completion ends early
        assert all(r["time_generate"] == r["time_logps"] == 0 for r in records[1:])  # no generation, no π_old
        assert os.listdir(folder / name) == ["metrics.jsonl"]  # no checkpoints, no model
    phases, arms = tables(folder / "benchmark.md")
    row = {c: {k: float(v[i]) for k, v in phases.items() if k != "configuration"}
           for i, c in enumerate(phases["configuration"])}
    assert list(row) == ["μ=1 β=0 fp32", "μ=4 β=0 fp32 generation step", "μ=4 β=0 fp32 reuse steps",
                         "μ=4 β=0 fp32 per step over a cycle", "μ=1 S=4 β=0 fp32 generation step",
                         "μ=1 S=4 β=0 fp32 later mini-batch steps", "μ=1 S=4 β=0 fp32 per step over a cycle"]
    one, four = row["μ=1 β=0 fp32"], row["μ=4 β=0 fp32 generation step"]
    big = row["μ=1 S=4 β=0 fp32 generation step"]
    g, l, r = one["generate"] / one["total"], four["logps"] / one["total"], big["generate"] / one["generate"]
    text = open(folder / "benchmark.md").read()
    printed = lambda pattern: float(re.search(pattern, text)[1])
    close = lambda a, b: math.isclose(a, b, rel_tol=0.01, abs_tol=0.002)  # the table: 3 significant digits
    assert close(printed(r"- g = ([\d.]+)"), g) and close(printed(r"- l = ([\d.]+)"), l)
    assert close(printed(r"r_4 = ([\d.]+)"), r)
    assert close(printed(r"decode: ([\d.e-]+) ms per token"), 1000 * one["generate"] / 8)
    assert close(printed(r"([\d.e-]+) ms for one 4× larger"), 1000 * big["generate"] / 8)
    predicted = {"μ=2": (1 - g) + (g + l) / 2, "μ=4": (1 - g) + (g + l) / 4,
                 "S=4": (1 - g) + (g * r + 4 * l) / 4}
    measured = {"μ=4": row["μ=4 β=0 fp32 per step over a cycle"]["total"] / one["total"],
                "S=4": row["μ=1 S=4 β=0 fp32 per step over a cycle"]["total"] / one["total"]}
    worth = {"μ=2": 1 - g + l, "μ=4": 1 - g + l / 3, "S=4": (4 * (1 - g) + g * r + 4 * l - 1) / 3}
    for i, arm in enumerate(arms["arm"]):
        assert close(float(arms["T(μ, S)/T(1, 1) predicted"][i]), predicted[arm])
        if arm == "μ=2":  # not among the configurations: predicted only
            assert arms["measured"][i] == "—"
        else:
            assert close(float(arms["measured"][i]), measured[arm])
        assert close(float(arms["break-even worth w*"][i]), worth[arm])
    out = capsys.readouterr().out
    assert "no-summary.json does not exist yet" in text and text.split("\n\n", 1)[1].strip() in out


@pytest.mark.parametrize("name, flag", [("benchmark", "--benchmark-steps"), ("lab", "--lrs"),
                                        ("update_clock", "--eval-every"), ("fixed_budget", "--plan"),
                                        ("heldout", "--samples"), ("ab", "--demo")])
def test_each_experiment_runs_as_a_module_from_the_root(name, flag):
    """python -m experiments.NAME from the repository's root: none edits sys.path to find the demo."""
    help_text = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--help"],
                               cwd=os.path.dirname(HERE), capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and flag in help_text.stdout, help_text.stderr
