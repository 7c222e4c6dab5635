"""The progression testbed: the task's answers and split, the starting model's accuracy, the rate choice, one
short run's rows, and the report's numbers on rows whose answers are known by hand."""
import math

import pytest

from experiments import addition_report as rep
from experiments import progression as pr
from experiments import progression_report as prr


def test_the_task_asks_a_progression_and_answers_31_to_39_tokens():
    assert pr.prompt(345, 7) == "345+7:" and pr.answer(345, 7) == "345,352,359,366,373,380,387,394"
    assert pr.answer(999, 9) == "999,1008,1017,1026,1035,1044,1053,1062"
    tokenizer = pr.make_tokenizer()
    lengths = [len(tokenizer(pr.answer(a, d), add_special_tokens=False)["input_ids"]) + 1
               for a in (100, 995, 999) for d in (1, 9)]
    assert min(lengths) == 32 and max(lengths) == 39 <= pr.MAX_COMPLETION  # with the EOS
    assert len(tokenizer(pr.prompt(999, 9))["input_ids"]) == 7 <= pr.CONFIG["max_prompt_length"]
    assert pr.exact_match(["1,2", "1,3", ""], ["1,2"] * 3) == [1.0, 0.0, 0.0]


def test_the_split_is_disjoint_and_covers_every_prompt():
    parts = pr.split()
    sets = {name: set(pairs) for name, pairs in parts.items()}
    assert sum(map(len, sets.values())) == 900 * 9 and len(sets["held_out"]) == 256
    assert not sets["held_out"] & sets["grpo"] and not sets["held_out"] & sets["supervised"]
    assert not sets["grpo"] & sets["supervised"] and len(sets["grpo"]) == 2048


def test_the_starting_model_scores_what_make_recorded(start_as_recorded):
    model, recorded = start_as_recorded(pr.MODEL, pr.TASK)
    assert recorded["weights"] == sum(p.numel() for p in model.parameters()) == 84416


def tuning_rows(arm, accuracy_by_lr, seeds=pr.SEEDS["tune"]):
    return [{"phase": "tune", "arm": arm, "lr": lr, "seed": seed, "attempt": "a", "code": "c",
             "completions": pr.BUDGET * pr.STEP_SIZE, "accuracy": acc, "end": True}
            for lr, acc in accuracy_by_lr.items() for seed in seeds]


def test_a_grid_is_extended_until_the_best_lies_inside():
    lo, mid, hi = pr.GRID
    rows = tuning_rows("μ=4", {lo: 0.4, mid: 0.3, hi: 0.1})
    assert pr.tuning_grid("μ=4", rows) == [lo / 2, lo, mid, hi] and "μ=4" not in pr.chosen_rates(rows)
    rows += tuning_rows("μ=4", {lo / 2: 0.35})
    assert pr.chosen_rates(rows)["μ=4"] == lo
    rows += tuning_rows("μ=1", {lo: 0.3, mid: 0.4, hi: 0.35})
    assert pr.planned("confirm", rows)[:2] == [("μ=1", mid, 101), ("μ=4", lo, 101)]
    assert pr.planned("tune", rows)[:3] == [("μ=1", lo, 1), ("μ=1", mid, 1), ("μ=1", hi, 1)]


def test_one_short_run_writes_its_rows_with_generation_cpu_seconds(tmp_path):
    model, tokenizer = pr.load_start()
    path = str(tmp_path / "rows.jsonl")
    pr.run_one({"phase": "test", "arm": "μ=2", "lr": 1e-4, "seed": 1}, model, tokenizer, path, max_batches=8)
    (row,) = pr.ad.read(path)
    assert (row["step"], row["completions"], row["end"]) == (16, 8 * pr.STEP_SIZE, True)
    assert row["kl"][0] == 0.0 and row["kl"][1] > 0.0 and row["train_reward"] == row["train_reward"]
    assert 0 < row["time"]["cpu_generate"] < row["cpu_seconds"] and "greedy" not in row


# ---- The report, on rows whose numbers are known ---------------------------------------------------------
def run(arm, lr, seed, points, time=None, phase="confirm"):
    """A finished run's rows: points [(mini-batches, cpu_seconds, accuracy)], greedy = accuracy + 0.3."""
    return [{"phase": phase, "arm": arm, "lr": lr, "seed": seed, "attempt": "a", "code": "c",
             "completions": k * pr.STEP_SIZE, "cpu_seconds": s, "accuracy": a, "greedy": a + 0.3,
             "time": time or {}, "clip": [0.0] * pr.ARMS[arm]["num_iterations"],
             "kl": [0.0] * pr.ARMS[arm]["num_iterations"], "outside": [0.0] * pr.ARMS[arm]["num_iterations"],
             "end": k == pr.BUDGET} for k, s, a in points]


def test_accuracy_at_cpu_seconds_is_read_linearly_between_evaluations():
    rows = run("μ=2", 1e-5, 101, [(64, 10.0, 0.40), (128, 30.0, 0.50)])
    assert prr.at_seconds(rows, 20.0, 0.30) == (pytest.approx(0.45), False)
    assert prr.at_seconds(rows, 5.0, 0.30) == (pytest.approx(0.35), False)  # from the start at 0 s
    assert prr.at_seconds(rows, 40.0, 0.30) == (pytest.approx(0.55), True)  # past the last: extrapolated


def test_per_second_pairs_each_seed_with_its_own_mu_1_time():
    runs = {}
    for seed, base_seconds in ((101, 20.0), (102, 25.0)):
        runs["confirm", "μ=1", 5e-5, seed] = run("μ=1", 5e-5, seed, [(pr.BUDGET, base_seconds, 0.5)])
        runs["confirm", "μ=4", 1e-5, seed] = run("μ=4", 1e-5, seed, [(64, 20.0, 0.4), (128, 40.0, 0.6)])
    found, beyond = prr.per_second(runs, "μ=4", 1e-5, 5e-5, 0.3)
    assert found == pytest.approx({101: 0.4, 102: 0.45}) and beyond == []


def test_generation_shares_from_the_trainers_seconds_and_cpu_time():
    """μ = 1: 6 s generating and 2 s updating over 8 mini-batches (g = 0.75), 5.4 CPU s generating out of
    9 (g_cpu = 0.6). μ = 2: its π_old pass 0.5 s over 4 mini-batches against μ = 1's update of 0.25 s a
    mini-batch: l = 0.5."""
    time = {"generate": 3.0, "forward": 0.5, "backward": 0.4, "optimizer": 0.1, "cpu_generate": 2.7,
            "logps": 0.0}
    runs = {("confirm", "μ=1", 5e-5, 101): run("μ=1", 5e-5, 101, [(4, 4.5, 0.3), (8, 9.0, 0.3)], time),
            ("confirm", "μ=2", 5e-5, 101): run("μ=2", 5e-5, 101, [(4, 7.0, 0.3)], {"logps": 0.5}),
            ("tune", "μ=1", 5e-5, 1): run("μ=1", 5e-5, 1, [(4, 99.0, 0.3)], dict(time, generate=99.0))}
    assert prr.shares(runs) == pytest.approx({"g": 0.75, "g_cpu": 0.6, "old": 0.5})


def confirmation_runs():
    """Three seeds. μ = 1 reaches 0.40, 0.41, 0.42 at the budget (64 mini-batches) in 20 CPU s. μ = 2 (rate
    2.5e-5) reaches it + 0.01, 0.02, 0.03 at the budget in 30 s, and at 32 mini-batches (20 s) 0.03, 0.02,
    0.01 below it: per step and per CPU second both read the same rows. μ = 4 reads -0.01, 0, +0.01 at 16
    mini-batches (20 s) and at the budget."""
    runs = {}
    for i, seed in enumerate((101, 102, 103)):
        base = 0.40 + i / 100
        runs["confirm", "μ=1", 5e-5, seed] = run("μ=1", 5e-5, seed, [(32, 10.0, base - 0.02),
                                                                       (64, 20.0, base)])
        runs["confirm", "μ=2", 2.5e-5, seed] = run("μ=2", 2.5e-5, seed, [(16, 10.0, base - 0.05),
                                                                          (32, 20.0, base - 0.03 + i / 100),
                                                                          (64, 30.0, base + 0.01 + i / 100)])
        runs["confirm", "μ=4", 1e-5, seed] = run("μ=4", 1e-5, seed, [(16, 20.0, base + (i - 1) / 100),
                                                                       (64, 50.0, base + (i - 1) / 100)])
    return runs


def test_the_six_comparisons_are_one_holm_family(monkeypatch):
    """μ = 2 per completion: differences 0.01, 0.02, 0.03 (mean 0.02, se 0.01/√3, t = 2√3, p = 0.0742 with
    2 degrees of freedom); per step and per CPU second: -0.03, -0.02, -0.01 (the same p). μ = 4: -0.01, 0,
    +0.01 at every reading (p = 1). No p-value passes Holm's first threshold, 6 × 0.0742 > 0.05, so every
    interval is at 1 - 0.05/6."""
    monkeypatch.setattr(pr, "chosen_rates", lambda rows: {"μ=1": 5e-5, "μ=2": 2.5e-5, "μ=4": 1e-5})
    lines, summary = prr.confirmation_section([], confirmation_runs(), 0.30)
    readings = summary["readings"]
    completion = readings["per completion, μ=2"]
    assert completion["mean"] == pytest.approx(0.02)
    assert completion["p"] == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), rel=1e-5)
    assert completion["p_holm"] == pytest.approx(min(1, 6 * completion["p"]))
    assert completion["level"] == pytest.approx(1 - 0.05 / 6)
    quantile = rep.t_quantile(1 - 0.05 / 12, 2)
    assert completion["high"] - completion["mean"] == pytest.approx(quantile * 0.01 / math.sqrt(3))
    assert readings["per step, μ=2"]["mean"] == pytest.approx(-0.02)
    assert readings["per CPU second, μ=2"]["mean"] == pytest.approx(-0.02)
    assert readings["per step, μ=4"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert readings["per CPU second, μ=4"]["p_holm"] == pytest.approx(1.0)
    assert readings["greedy per completion, μ=2"]["mean"] == pytest.approx(0.02)
    assert summary["margin"] == pytest.approx({"gain": 0.11, "share": 0.03 / 0.11})
    assert summary["arms"]["μ=2"]["cpu_seconds"] == 30.0


def test_a_paired_mean_of_exactly_zero_has_p_1():
    assert rep.t_interval([-0.01, 0.0, 0.01])["p"] == 1.0
    assert rep.t_interval([-0.01, 0.0, 0.02])["p"] == pytest.approx(1 - 1 / math.sqrt(1 + 2 * 7), rel=1e-5)


def test_the_curve_is_read_where_it_rises():
    curve = [(128, 0.36), (256, 0.33), (512, 0.35), (1024, 0.40)]
    assert prr.rising_tail(curve) == curve[1:]
    assert prr.rising_tail([(128, 0.3), (256, 0.4)]) == [(128, 0.3), (256, 0.4)]


def test_the_break_even_share_on_a_toy_curve(monkeypatch):
    """μ = 1's mean curve climbs 2 points from 512 to 1,024 completions. μ = 2 is +2 [+1, +3] points: μ = 1
    needs c = 2 [√2, 2√2] times the completions (the last doubling extended past 1,024). l: μ = 2's π_old
    pass, 1 s over 128 mini-batches, against μ = 1's update, 4 s over 128: 0.25. g* = (2.25 - c)/1.25 =
    0.2 [-0.46, 0.67]."""
    monkeypatch.setattr(pr, "chosen_rates", lambda rows: {"μ=1": 5e-5, "μ=2": 2.5e-5, "μ=4": 1e-5})
    runs = {}
    time = {"generate": 3.0, "forward": 0.5, "backward": 0.4, "optimizer": 0.1, "cpu_generate": 2.7,
            "logps": 0.0}
    for seed in (101, 102):
        runs["confirm", "μ=1", 5e-5, seed] = run("μ=1", 5e-5, seed, [(32, 10.0, 0.38), (64, 20.0, 0.40)],
                                                 time)
        runs["confirm", "μ=2", 2.5e-5, seed] = run("μ=2", 2.5e-5, seed, [(64, 30.0, 0.42)], {"logps": 0.5})
    summary = {"arms": {"μ=1": {"rate": 5e-5, "cpu_seconds": 20.0}, "μ=2": {"cpu_seconds": 30.0}},
               "readings": {"per completion, μ=2": {"mean": 0.02, "low": 0.01, "high": 0.03}}}
    lines, out = prr.timing_section(runs, summary)
    row = out["break_even"]["μ=2"]
    assert out["measured"]["old"] == pytest.approx(0.25)
    old = 0.25
    assert row["ratio"] == pytest.approx({"mean": 2.0, "low": math.sqrt(2), "high": 2 * math.sqrt(2)})
    assert row["g_star"] == pytest.approx({"mean": 0.2, "low": (2.25 - 2 * math.sqrt(2)) / 1.25,
                                           "high": (2.25 - math.sqrt(2)) / 1.25})
    assert row["measured_time"] == pytest.approx(1.5)
    assert row["predicted_time"] == pytest.approx(0.75 + 0.25 * 2.25)  # g = 0.75 measured
