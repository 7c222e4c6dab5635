"""The addition testbed: the task's answers, the rewards' known values, the split, the starting model's
accuracy, the metrics' two namings, the budget clock, the rate choice, and one short run's rows."""
import math

import pytest
import torch

from experiments import addition as ad


def test_the_task_asks_a_sum_and_answers_its_digits():
    assert ad.prompt(12, 34) == "12+34=" and ad.answer(12, 34) == "46"
    assert ad.answer(99, 99) == "198" and ad.answer(0, 0) == "0" and ad.answer(5, 95) == "100"
    tokenizer = ad.make_tokenizer()
    ids = tokenizer(ad.prompt(7, 30))["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("7+30=")
    answer = tokenizer(ad.answer(7, 30), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert tokenizer.decode(answer, skip_special_tokens=True) == "37"


def test_the_rewards_known_values():
    completions = ["46", "47", "4", "461", "", "046"]
    assert ad.exact_match(completions, ["46"] * 6) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert ad.digit_credit(completions, ["46"] * 6) == pytest.approx([1, 1 / 2, 1 / 2, 2 / 3, 0, 0])
    assert ad.digit_credit(["198"], ["198"]) == [1.0]


def test_the_held_out_split_is_disjoint_from_every_training_prompt():
    parts = ad.split()
    sets = {name: set(pairs) for name, pairs in parts.items()}
    assert sum(map(len, sets.values())) == 100 * 100  # every ordered pair, once
    assert not sets["held_out"] & sets["grpo"] and not sets["held_out"] & sets["supervised"]
    assert not sets["grpo"] & sets["supervised"]
    for pairs in sets.values():  # a pair's other order is in the same set
        assert all((b, a) in pairs for a, b in pairs)
    prompts = {name: {ad.prompt(a, b) for a, b in pairs} for name, pairs in parts.items()}
    assert not prompts["held_out"] & (prompts["grpo"] | prompts["supervised"])
    assert len(parts["held_out"]) == 495 and len(parts["grpo"]) == 1985


def test_the_starting_model_scores_what_make_recorded(start_as_recorded):
    start_as_recorded(ad.MODEL, ad.TASK)


def test_supervised_training_repeats_from_its_seed():
    first, _ = ad.train_start(steps=3)
    second, _ = ad.train_start(steps=3)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


def test_held_out_scoring_leaves_the_random_stream_alone():
    model, tokenizer = ad.load_start()
    pairs = ad.split()["held_out"][:20]
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = ad.accuracy(model, tokenizer, pairs)
    assert torch.equal(torch.rand(3), expected)
    assert ad.accuracy(model, tokenizer, pairs) == first  # the same seed every time


def test_metrics_are_read_under_either_naming():
    trl = {"clip_ratio/region_mean": 0.25, "completions/mean_length": 3.5, "reward": 0.5}
    older = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.15, "completion_length": 3.5, "reward": 0.5}
    for metrics in (trl, older):
        assert ad.metric(metrics, "clip") == pytest.approx(0.25)
        assert ad.metric(metrics, "length") == 3.5 and ad.metric(metrics, "reward") == 0.5
    assert ad.metric({"clip_ratio/low_mean": 0.1, "clip_ratio/high_mean": 0.2}, "clip") == pytest.approx(0.3)
    assert ad.metric({"loss": 1.0}, "reward") is None


def test_a_budget_is_spent_after_mu_steps_per_mini_batch():
    assert [ad.steps_at(arm, 32) for arm in ("μ=1", "μ=2", "μ=4", "μ=8", "S=4")] == [32, 64, 128, 256, 32]
    assert ad.cycle("S=4") == (4, 4) and ad.cycle("μ=8") == (1, 8) and ad.cycle("μ=4 no clip") == (1, 4)
    with pytest.raises(ValueError, match="not whole generation batches of S=4"):
        ad.steps_at("S=4", 6)


def tuning_rows(arm, accuracy_by_lr):
    """A finished tuning phase's rows for one arm: {lr: (accuracy at 32, at 128)}, the same on every seed."""
    rows = []
    for lr, (short, long) in accuracy_by_lr.items():
        for seed in ad.SEEDS["tune"]:
            for batches, acc in ((32, short), (128, long)):
                rows.append({"phase": "tune", "arm": arm, "lr": lr, "seed": seed, "attempt": "a",
                             "completions": batches * ad.STEP_SIZE, "accuracy": acc, "end": batches == 128})
    return rows


def test_a_grid_is_extended_beyond_an_edge_until_each_best_lies_inside():
    lo, a, b, hi = ad.GRID
    rows = tuning_rows("μ=1", {lo: (0.1, 0.1), a: (0.2, 0.3), b: (0.3, 0.2), hi: (0.4, 0.1)})
    assert ad.tuning_grid("μ=1", rows) == sorted(ad.GRID + (hi * 2,))
    assert ("μ=1", 32) not in ad.chosen_rates(rows)  # its best lies at an edge: not over
    rows += tuning_rows("μ=1", {hi * 2: (0.35, 0.1)})
    assert ad.tuning_grid("μ=1", rows) == sorted(ad.GRID + (hi * 2,))
    chosen = ad.chosen_rates(rows)
    assert chosen[("μ=1", 32)] == hi and chosen[("μ=1", 128)] == a
    cut_short = rows[:-1]  # the last run has not ended: its rate is not complete
    assert ("μ=1", 32) not in ad.chosen_rates(cut_short)


def test_the_clip_off_arm_is_confirmed_at_the_clipped_arms_rates():
    lo, a, b, hi = ad.GRID
    rows = tuning_rows("μ=4", {lo: (0.1, 0.1), a: (0.3, 0.2), b: (0.2, 0.3), hi: (0.1, 0.1)})
    rows += tuning_rows("μ=4 no clip", {lo: (0.1, 0.1), a: (0.1, 0.1), b: (0.2, 0.1), hi: (0.1, 0.1)})
    chosen = ad.chosen_rates(rows)
    assert chosen[("μ=4 no clip", 32)] == a and chosen[("μ=4 no clip", 128)] == b
    assert ad.tasks("confirm", rows)[:4] == [("μ=4", a, 101), ("μ=4", b, 101), ("μ=4 no clip", a, 101),
                                             ("μ=4 no clip", b, 101)]
    assert ad.tasks("bridge", rows) == [("μ=4", a, 1), ("μ=4", b, 1), ("μ=4 no clip", a, 1),
                                        ("μ=4 no clip", b, 1)]
    assert ad.run_length("confirm", "μ=4", a, rows) == 32 and ad.run_length("confirm", "μ=4", b, rows) == 128
    assert ad.run_length("tune", "μ=4", a, rows) == 128


def test_one_short_run_writes_its_rows(tmp_path):
    model, tokenizer = ad.load_start()
    path = str(tmp_path / "rows.jsonl")
    ad.run_one({"phase": "test", "arm": "μ=2", "lr": 1e-4, "seed": 1}, model, tokenizer, path, max_batches=4)
    (row,) = ad.read(path)
    assert (row["step"], row["completions"], row["end"]) == (8, 256, True)
    assert row["kl"][0] == 0.0 and row["kl"][1] > 0.0 and row["clip"][0] == 0.0
    assert 0.0 <= row["accuracy"] <= 1.0 and row["train_reward"] is not None


def test_the_reports_statistics_give_known_answers():
    from experiments import addition_report as rep
    assert rep.t_quantile(0.975, 19) == pytest.approx(2.093, abs=1e-3)
    assert rep.t_quantile(0.975, 2) == pytest.approx(4.303, abs=1e-3)
    stat = rep.paired({1: 0.5, 2: 0.6, 3: 0.7}, {1: 0.4, 2: 0.4, 3: 0.4, 4: 0.9})  # seed 4 is unpaired
    assert stat["n"] == 3 and stat["mean"] == pytest.approx(0.2) and stat["median"] == pytest.approx(0.2)
    assert (stat["low"], stat["high"]) == pytest.approx((0.2 - 4.303 * 0.1 / 3 ** 0.5,
                                                         0.2 + 4.303 * 0.1 / 3 ** 0.5), abs=1e-4)
    assert rep.reading({"low": 0.01, "high": 0.05}) == "higher"
    assert rep.reading({"low": -0.02, "high": 0.025}) == "no difference (inside ±3 points)"
    assert rep.reading({"low": -0.05, "high": 0.01}) == "inconclusive"
    assert rep.predicted(0.5, 1, 1, 1.0) == 1.0
    assert rep.predicted(0.5, 4, 1, 1.0) == pytest.approx(0.5 + 0.5 * (4 + 1 / 3))


def test_a_run_that_stopped_at_the_smaller_budget_is_read_at_that_budget_only():
    from experiments import addition_report as rep
    row = {"phase": "bridge", "arm": "μ=2", "lr": 1.25e-5, "seed": 1, "completions": 32 * ad.STEP_SIZE,
           "accuracy": 0.31}
    runs = {("bridge", "μ=2", 1.25e-5, 1): [row]}
    assert rep.by_seed(runs, "bridge", "μ=2", 1.25e-5, 32) == {1: 0.31}
    assert rep.by_seed(runs, "bridge", "μ=2", 1.25e-5, 128) == {}


def test_per_step_reads_mu_2_after_half_the_completions_of_mu_1(monkeypatch):
    from experiments import addition_report as rep
    every_rate = {(arm, b): 1e-5 for arm in ad.ARMS for b in ad.BUDGETS}
    monkeypatch.setattr(ad, "chosen_rates", lambda rows: every_rate)
    runs = {}
    for seed, (a, b) in zip((101, 102, 103), ((0.30, 0.28), (0.32, 0.29), (0.31, 0.29))):
        runs["confirm", "μ=1", 1e-5, seed] = [{"completions": 32 * ad.STEP_SIZE, "accuracy": a}]
        runs["confirm", "μ=2", 1e-5, seed] = [{"completions": 16 * ad.STEP_SIZE, "accuracy": b}]
    _, summary = rep.per_step_section([], runs)
    entry = summary["per_step"]["μ=2 @ step 32"]
    assert entry["completions"] == 16 * ad.STEP_SIZE
    assert entry["vs μ=1"]["mean"] == pytest.approx(-0.0233, abs=1e-4)


def test_per_pass_averages_each_pass_over_every_step_of_the_confirmation_runs(monkeypatch):
    from experiments import addition_report as rep
    every_rate = {(arm, b): 1e-5 for arm in ad.ARMS for b in ad.BUDGETS}
    monkeypatch.setattr(ad, "chosen_rates", lambda rows: every_rate)

    def row(arm, x):  # x at every pass after the first, which is on-policy
        passes = ad.cycle(arm)[1]
        return {field: [0.0] + [x] * (passes - 1) for field in ("clip", "kl", "outside")}
    runs = {}
    for arm in ad.ARMS:
        runs["confirm", arm, 1e-5, 101] = [row(arm, 0.1), row(arm, 0.2)]
        runs["confirm", arm, 1e-5, 102] = [row(arm, 0.6)]
        runs["tune", arm, 1e-5, 1] = [row(arm, 0.9)]  # another phase: not read
    _, summary = rep.per_pass_section([], runs)
    assert summary["per_pass"]["μ=2"]["clip"] == pytest.approx([0.0, 0.3])
    assert summary["per_pass"]["μ=1"]["kl"] == [0.0]


def test_t_tail_and_quantile_match_the_closed_forms_of_one_and_two_degrees_of_freedom():
    from experiments import addition_report as rep
    assert rep.t_tail(100.0, 1) == pytest.approx(0.5 - math.atan(100.0) / math.pi, rel=1e-6)
    assert rep.t_tail(3.0, 2) == pytest.approx(0.5 * (1 - 3.0 / math.sqrt(9.0 + 2)), rel=1e-6)
    assert rep.t_tail(30.0, 2) == pytest.approx(0.5 * (1 - 30.0 / math.sqrt(900.0 + 2)), rel=1e-6)
    p = 0.9875  # Student's t with 2 degrees of freedom: the quantile is (2p - 1) / sqrt(2p(1 - p))
    assert rep.t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), abs=1e-6)


def test_holm_adjusts_a_textbook_family_of_four_p_values():
    from experiments import addition_report as rep
    out = rep.holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005})
    # Sorted: d 4 × 0.005 = 0.02, a 3 × 0.01 = 0.03, c 2 × 0.03 = 0.06 (kept), b max(0.06, 1 × 0.04).
    assert {k: v["p_holm"] for k, v in out.items()} == pytest.approx({"d": 0.02, "a": 0.03, "c": 0.06,
                                                                      "b": 0.06})
    assert {k: v["level"] for k, v in out.items()} == pytest.approx({"d": 1 - 0.05 / 4, "a": 1 - 0.05 / 3,
                                                                     "c": 0.975, "b": 0.975})


def test_corrected_intervals_by_hand_for_two_comparisons_with_two_degrees_of_freedom():
    """Differences 0.1, 0.2, 0.3 (t = 2√3) and 0.5, 0.6, 0.7 (t = 6√3), standard error 0.1/√3. With 2
    degrees of freedom the two-sided p is 1 - t/√(t² + 2): 0.0742 and 0.00913. Holm: 2 × 0.00913 < 0.05,
    so the second's interval is at 97.5 %; 0.0742 is kept, at 95 %."""
    from experiments import addition_report as rep
    zero = {1: 0.0, 2: 0.0, 3: 0.0}
    out = rep.corrected({"x": ({1: 0.1, 2: 0.2, 3: 0.3}, zero), "y": ({1: 0.5, 2: 0.6, 3: 0.7}, zero)})
    error = 0.1 / math.sqrt(3)
    assert out["x"]["p"] == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14), rel=1e-5)
    assert out["y"]["p"] == pytest.approx(1 - 6 * math.sqrt(3) / math.sqrt(110), rel=1e-5)
    assert out["y"]["p_holm"] == pytest.approx(2 * out["y"]["p"]) and out["x"]["p_holm"] == out["x"]["p"]
    quantile = 0.975 / math.sqrt(2 * 0.9875 * 0.0125)  # t's 98.75 % point, 2 degrees of freedom: 6.2054
    assert (out["y"]["low"], out["y"]["high"]) == pytest.approx((0.6 - quantile * error,
                                                                 0.6 + quantile * error))
    assert (out["x"]["low"], out["x"]["high"]) == pytest.approx((0.2 - 4.3027 * error, 0.2 + 4.3027 * error),
                                                                abs=1e-4)
    assert out["y"]["uncorrected"]["low"] == pytest.approx(0.6 - 4.3027 * error, abs=1e-4)


def test_the_margin_against_mu_1_s_gain_from_the_start():
    from experiments import addition_report as rep
    confirmation = {"μ=1 @ 2048": {"mean": 0.32}, "μ=1 @ 8192": {"mean": 0.35}, "μ=2 @ 8192": {"mean": 0.9}}
    margin = rep.margin_against_gain(confirmation, 0.27)
    assert margin["2048"] == pytest.approx({"gain": 0.05, "share": 0.6})
    assert margin["8192"] == pytest.approx({"gain": 0.08, "share": 0.375})


def test_the_confirmation_corrects_sampled_and_greedy_each_as_a_family(monkeypatch):
    """μ = 2 against μ = 1 at both budgets: each metric's family holds two comparisons. Greedy: μ = 2 is
    0.1, 0.2, 0.3 above at 2,048 (p = 0.0742) and 0.5, 0.6, 0.7 at 8,192 (p = 0.00913): 97.5 % and 95 %."""
    from experiments import addition_report as rep
    monkeypatch.setattr(ad, "chosen_rates", lambda rows: {(arm, b): 1e-5 for arm in ("μ=1", "μ=2")
                                                          for b in ad.BUDGETS})
    runs = {}
    for seed, (small, large) in zip((101, 102, 103), ((0.1, 0.5), (0.2, 0.6), (0.3, 0.7))):
        for arm, extra in (("μ=1", 0.0), ("μ=2", 1.0)):
            rows = [{"completions": 32 * ad.STEP_SIZE, "accuracy": 0.3 + seed / 1e3 + extra * small / 10,
                     "greedy": 0.4 + extra * small},
                    {"completions": 128 * ad.STEP_SIZE,
                     "accuracy": 0.35 + seed ** 2 / 1e6 + extra * large / 10,
                     "greedy": 0.5 + extra * large}]
            runs["confirm", arm, 1e-5, seed] = rows
    _, summary = rep.confirmation_section([], runs, 0.27)
    small, large = (summary["confirmation"][f"μ=2 @ {b * ad.STEP_SIZE}"]["greedy_vs"] for b in ad.BUDGETS)
    assert (small["level"], large["level"]) == pytest.approx((0.95, 0.975))
    assert small["mean"] == pytest.approx(0.2) and large["p_holm"] == pytest.approx(2 * large["p"])
    assert summary["margin"]["2048"]["gain"] == pytest.approx(0.3 + 0.102 - 0.27)


def test_interpolate_and_the_completions_ratio_on_a_toy_curve():
    """μ = 1 climbs 2 points from 256 to 512 completions and 4 from 512 to 1,024. At 512, +2 points is
    half the next doubling (512·√2), -1 point half the doubling before (256·√2), and +6 points lies past
    the curve: its last segment, 4 points a doubling, extended by half a doubling (1,024·√2)."""
    from experiments import addition_report as rep
    points = [(0, 0), (1, 2), (3, 3)]
    assert [rep.interpolate(points, x) for x in (2, -1, 5)] == [2.5, -2, 4]
    curve = [(256, 0.20), (512, 0.22), (1024, 0.26)]
    ratio = rep.completions_ratio(curve, 512, {"mean": 0.02, "low": -0.01, "high": 0.06})
    assert ratio == pytest.approx({"mean": math.sqrt(2), "low": math.sqrt(2) / 2, "high": 2 * math.sqrt(2)})


def test_the_break_even_share_the_seeds_to_decide_and_the_reading():
    from experiments import addition_report as rep
    assert rep.break_even_share(4 / 3, 4, 1.0, 1 / 3) == pytest.approx(0.9)  # μ = 4 costs 4/3 at g = 0.9
    assert rep.predicted(rep.break_even_share(1.7, 8, 1.0, 0.39), 8, 1, 1.0, 0.39) == pytest.approx(1.7)
    assert rep.break_even_share(1.0, 1, 0.25, 0.5) == pytest.approx(0.4)  # S = 4, launch-bound: 0.5/1.25
    diff = {"mean": 0.25, "low": -0.25, "high": 0.75, "n": 20}  # half width 0.5
    assert rep.seeds_to_decide(diff, 0.75) == 20 and rep.seeds_to_decide(diff, 0.5) == 80
    assert [rep.pays_at(g, {"low": 0.5, "high": 0.8}) for g in (0.9, 0.4, 0.6)] == ["pays", "does not pay",
                                                                                    "undecided"]
    assert [rep.share(x) for x in (1.2, -0.1, 0.456)] == ["≥ 1", "≤ 0", "0.46"]


def test_the_break_even_section_reads_mu_4_on_mu_1_s_curve(monkeypatch):
    """μ = 1's mean climbs 1 point a doubling. μ = 4 at 2,048 is 1 point [0, 2] above: μ = 1 needs 2 [1, 4]
    times the completions, so g* = (4 + 1/3 - c)/(4 + 1/3 - 1) = 0.7 [0.1, 1]. At g = 0.9 μ = 4 costs 4/3,
    worth log2(4/3) points on the curve: 3 seeds would have to become 3 (1 / (1 - log2(4/3)))² or so."""
    from experiments import addition_report as rep
    monkeypatch.setattr(ad, "chosen_rates", lambda rows: {(arm, b): 1e-5 for arm in ("μ=1", "μ=4")
                                                          for b in ad.BUDGETS})
    runs = {}
    for seed in (101, 102, 103):
        runs["confirm", "μ=1", 1e-5, seed] = [{"completions": k * ad.STEP_SIZE,
                                               "accuracy": 0.2 + 0.01 * math.log2(k) + (seed - 102) / 1e3}
                                              for k in ad.EVALS]
    diff = {"arm": "μ=1", "mean": 0.01, "low": 0.0, "high": 0.02, "n": 3}
    below = {"arm": "μ=1", "mean": -0.005, "low": -0.01, "high": 0.005, "n": 3}  # its top end past 8,192
    lines, summary = rep.break_even_section([], runs, {"μ=4 @ 2048": {"vs": diff},
                                                       "μ=4 @ 8192": {"vs": below}}, 1 / 3)
    assert lines[-1].endswith("8,192: 27.0; its last doubling +1.0 points.")
    small, large = summary["break_even"]["rows"]
    assert small["ratio"] == pytest.approx({"mean": 2.0, "low": 1.0, "high": 4.0})
    assert small["g_star"] == pytest.approx({"mean": 0.7, "low": 0.1, "high": 1.0})
    assert small["at"]["reading"] == "undecided" and not small["extrapolated"] and large["extrapolated"]
    assert small["at"]["seeds_to_decide"] == math.ceil(3 * (1 / (1 - math.log2(4 / 3))) ** 2)
