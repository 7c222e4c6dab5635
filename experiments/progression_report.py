"""
The report of experiments/progression.py's rows (docs/progression/plan.md says what it computes and why).

    python -m experiments.progression_report [runs/progression/rows.jsonl]

writes table.md and accuracy.png into docs/progression, and rows.jsonl (a copy of the rows it read) and
summary.json into experiments/progression_results. Before any confirmation row it reports the tuning phase
alone (and says so). The statistics are addition_report's: t-intervals, Holm's correction, the reading
against the ±3-point margin, the completions ratio and the break-even share.
"""
import os, statistics

from experiments import addition_report as rep
from experiments import progression as pr

START = os.path.join(pr.MODEL, "start.json")
COMPARED = ("μ=2", "μ=4")  # each against μ = 1
READINGS = ("per completion", "per step", "per CPU second")


# ---- The rows -------------------------------------------------------------------------------------------
def by_seed(runs, phase, arm, lr, batches, field="accuracy"):
    """{seed: the field after `batches` mini-batches of 16} of the phase's finished runs of (arm, lr)."""
    return rep.by_seed(runs, phase, arm, lr, batches, field, pr.STEP_SIZE)


def at_seconds(run, seconds, start):
    """The run's held-out accuracy after `seconds` of training CPU time: linear between the two evaluations
    around it on the curve through (0, start) and its rows' (cpu_seconds, accuracy); past its last row
    along its last segment. (accuracy, True where that was an extrapolation)."""
    points = [(0.0, start)] + [(r["cpu_seconds"], r["accuracy"]) for r in run]
    return rep.interpolate(points, seconds), seconds > points[-1][0]


def per_second(runs, arm, lr, base_lr, start):
    """{seed: the arm's accuracy at the CPU seconds that μ = 1 (at base_lr) took to spend the budget} over
    the seeds that both have, and the seeds where that time lay past the arm's last evaluation."""
    found, beyond = {}, []
    for (p, a, x, seed), run in runs.items():
        if (p, a, x) != ("confirm", arm, lr):
            continue
        base = runs.get(("confirm", "μ=1", base_lr, seed))
        row = None if base is None else rep.at_budget(base, pr.BUDGET, pr.STEP_SIZE)
        if row is None:
            continue
        found[seed], past = at_seconds(run, row["cpu_seconds"], start)
        if past:
            beyond.append(seed)
    return found, beyond


def shares(runs, phase="confirm"):
    """Generation's share of a μ = 1 step, from the trainer's wall-clock seconds per phase (generate over
    generate + forward + backward + optimizer, "g") and in CPU time (the testbed's generation CPU seconds
    over the whole step's, "g_cpu"); and "old", the π_old pass of a μ > 1 mini-batch against μ = 1's update
    of one, in wall-clock seconds. Sums over the phase's finished runs; {} without μ = 1 runs."""
    sums = {"generate": 0.0, "update": 0.0, "cpu_generate": 0.0, "cpu": 0.0, "batches": 0, "old": 0.0,
            "old_batches": 0}
    for (p, arm, _, _), run in runs.items():
        if p != phase:
            continue
        seconds = {}
        for r in run:
            for name, value in r["time"].items():
                seconds[name] = seconds.get(name, 0.0) + value
        batches = run[-1]["completions"] // pr.STEP_SIZE
        if arm == "μ=1":
            sums["generate"] += seconds["generate"]
            sums["update"] += seconds["forward"] + seconds["backward"] + seconds["optimizer"]
            sums["cpu_generate"] += seconds["cpu_generate"]
            sums["cpu"] += run[-1]["cpu_seconds"]
            sums["batches"] += batches
        else:
            sums["old"] += seconds["logps"]
            sums["old_batches"] += batches
    if not sums["batches"]:
        return {}
    out = {"g": sums["generate"] / (sums["generate"] + sums["update"]),
           "g_cpu": sums["cpu_generate"] / sums["cpu"]}
    if sums["old_batches"]:
        out["old"] = sums["old"] / sums["old_batches"] / (sums["update"] / sums["batches"])
    return out


def rising_tail(curve):
    """The curve's last points along which accuracy rises strictly, ending at its last: log2(completions)
    is read as a function of accuracy only where each accuracy has one number of completions."""
    start = len(curve) - 1
    while start > 0 and curve[start - 1][1] < curve[start][1]:
        start -= 1
    return curve[start:]


def median_seconds(runs, phase, arm, lr, batches):
    """The median training CPU seconds to spend `batches` mini-batches over the phase's runs of (arm, lr)."""
    values = list(by_seed(runs, phase, arm, lr, batches, "cpu_seconds").values())
    return statistics.median(values) if values else None


# ---- The sections ---------------------------------------------------------------------------------------
def comparisons(runs, chosen, start):
    """The plan's six comparisons against μ = 1, {(reading, arm): (arm's {seed: value}, μ = 1's)}, and the
    greedy family's two, with the seeds where the per-second reading extrapolated."""
    base = chosen["μ=1"]
    at_budget = by_seed(runs, "confirm", "μ=1", base, pr.BUDGET)
    family, greedy, beyond = {}, {}, {}
    for arm in COMPARED:
        mu = pr.ARMS[arm]["num_iterations"]
        family["per completion", arm] = (by_seed(runs, "confirm", arm, chosen[arm], pr.BUDGET), at_budget)
        family["per step", arm] = (by_seed(runs, "confirm", arm, chosen[arm], pr.BUDGET // mu), at_budget)
        timed, beyond[arm] = per_second(runs, arm, chosen[arm], base, start)
        family["per CPU second", arm] = (timed, at_budget)
        greedy[arm] = (by_seed(runs, "confirm", arm, chosen[arm], pr.BUDGET, "greedy"),
                       by_seed(runs, "confirm", "μ=1", base, pr.BUDGET, "greedy"))
    return family, greedy, beyond


def confirmation_section(rows, runs, start):
    chosen, seeds = pr.chosen_rates(rows), pr.SEEDS["confirm"]
    budget = pr.BUDGET * pr.STEP_SIZE
    family, greedy, beyond = comparisons(runs, chosen, start)
    diffs = rep.corrected({k: v for k, v in family.items() if len(set(v[0]) & set(v[1])) >= 2})
    greedy_diffs = rep.corrected({k: v for k, v in greedy.items() if len(set(v[0]) & set(v[1])) >= 2})
    lines = [f"## Confirmation (seeds {seeds[0]}-{seeds[-1]}): each arm at its chosen rate, {budget:,} "
             "completions", "",
             "Held-out exact match (%), sampled at T = 1 (the plan's score): mean [95 % t-interval], median, "
             "collapse share; greedy (T = 1e-4, the secondary metric, never used to choose): mean [95 %]; "
             "training CPU seconds to spend the budget (median).", "",
             "| arm | rate | seeds | sampled | median | collapsed | greedy | CPU s |",
             "|---|---|---|---|---|---|---|---|"]
    summary = {"arms": {}}
    for arm in pr.ARMS:
        values = by_seed(runs, "confirm", arm, chosen[arm], pr.BUDGET)
        if len(values) < 2:
            continue
        stat = rep.t_interval(list(values.values()))
        greedy_stat = rep.t_interval(list(by_seed(runs, "confirm", arm, chosen[arm], pr.BUDGET,
                                                  "greedy").values()))
        fallen = sum(rep.collapsed(v, start) for v in values.values())
        seconds = median_seconds(runs, "confirm", arm, chosen[arm], pr.BUDGET)
        summary["arms"][arm] = {"rate": chosen[arm], **stat, "collapsed": fallen, "greedy": greedy_stat,
                                "cpu_seconds": seconds}
        lines.append(f"| {arm} | {chosen[arm]:g} | {stat['n']} | {rep.fmt(stat)} | "
                     f"{rep.pct(stat['median'])} | "
                     f"{fallen}/{stat['n']} | {rep.fmt(greedy_stat)} | {seconds:.1f} |")
    if "μ=1" in summary["arms"]:
        gain = summary["arms"]["μ=1"]["mean"] - start
        summary["margin"] = {"gain": gain, "share": rep.MARGIN / gain}
        lines += ["", f"μ = 1's gain from the start ({rep.pct(start)} %) at {budget:,} completions: "
                  f"{100 * gain:+.1f} points; the ±3-point margin is {100 * rep.MARGIN / gain:.0f} % of it."]
    lines += ["", "Δ against μ = 1, paired by seed, in points: the plan's six comparisons (three readings × "
              "two arms) corrected together by Holm's step-down method (the k-th smallest p-value's interval "
              "at 1 − 0.05/(6 − k + 1), held from the first that Holm does not reject), the uncorrected 95 % "
              "interval beside; greedy's two comparisons are a family of their own. Per step: μ = 2 after "
              f"{pr.BUDGET // 2} mini-batches, μ = 4 after {pr.BUDGET // 4} ({pr.BUDGET} optimizer steps, "
              "μ = 1's). Per CPU second: the arm's "
              "accuracy at the CPU seconds that the same seed's μ = 1 took to spend the budget, linear "
              "between the arm's evaluations.", "",
              "| reading | arm | seeds | Δ, Holm | Δ uncorrected | Δ median | p (Holm) | reading |",
              "|---|---|---|---|---|---|---|---|"]
    summary["readings"] = {}
    for reading in READINGS:
        for arm in COMPARED:
            if (reading, arm) not in diffs:
                continue
            d = diffs[reading, arm]
            words = rep.reading(d)
            summary["readings"][f"{reading}, {arm}"] = {**d, "reading": words}
            lines.append(f"| {reading} | {arm} | {d['n']} | {rep.signed(d)} | "
                         f"{rep.signed(d['uncorrected'])} | "
                         f"{100 * d['median']:+.1f} | {d['p_holm']:.3g} | {words} |")
    for arm in COMPARED:
        if arm in greedy_diffs:
            d = greedy_diffs[arm]
            words = rep.reading(d)
            summary["readings"][f"greedy per completion, {arm}"] = {**d, "reading": words}
            lines.append(f"| greedy, per completion | {arm} | {d['n']} | {rep.signed(d)} | "
                         f"{rep.signed(d['uncorrected'])} | {100 * d['median']:+.1f} | {d['p_holm']:.3g} | "
                         f"{words} |")
    extrapolated = {arm: seeds for arm, seeds in beyond.items() if seeds}
    if extrapolated:
        lines += ["", f"Per CPU second, extrapolated past the arm's last evaluation: {extrapolated}."]
    summary["per_second_extrapolated"] = extrapolated
    return lines, summary


def timing_section(runs, summary):
    """g measured, and in TRL PR #2899's terms: the completions μ = 1 needs to match each arm (c) and the
    generation share g* above which the cost model says the arm pays, beside the measured reading."""
    measured = shares(runs)
    if not measured or "old" not in measured:
        return [], {}
    chosen_mu1 = summary["arms"]["μ=1"]["rate"]
    curve = rising_tail(rep.mean_curve(runs, "μ=1", chosen_mu1, pr.EVALS, pr.STEP_SIZE))
    budget = pr.BUDGET * pr.STEP_SIZE
    lines = ["## Generation's share, and TRL PR #2899's terms", "",
             "Generation's share of a μ = 1 step, from the confirmation's μ = 1 runs: "
             f"g = {measured['g']:.3f} "
             "by the trainer's wall-clock seconds per phase (generate / (generate + forward + backward + "
             f"optimizer)), g = {measured['g_cpu']:.3f} in CPU time (the generation's CPU seconds over the "
             "whole step's, which also holds the rewards, the advantages and the batching); the π_old pass "
             f"of a μ > 1 mini-batch against μ = 1's update: l = {measured['old']:.2f}.", "",
             "c: the completions μ = 1 needs to reach each arm's mean accuracy at the budget, over the "
             "arm's, on μ = 1's mean curve (its last evaluations, along which it rises) with "
             "log2(completions) linear in accuracy between evaluations (past "
             f"{budget:,} along the last segment: an extrapolation, *); its interval carries the ends of the "
             "Holm-corrected per-completion interval through the same curve, taken as exact. g* = (μ + l − c)"
             "/(μ + l − 1): the cost model's generation share above which the arm pays per second. Beside "
             "it, the cost model's prediction of the arm's time per completion against μ = 1's at the g "
             "measured here, and the arm's measured CPU time against μ = 1's (medians).", "",
             "| arm | c [interval] | g* [interval] | at the measured g | predicted time | measured time |",
             "|---|---|---|---|---|---|"]
    rows = {}
    base_seconds = summary["arms"]["μ=1"]["cpu_seconds"]
    for arm in COMPARED:
        d = summary["readings"].get(f"per completion, {arm}")
        if d is None or arm not in summary["arms"]:
            continue
        mu = pr.ARMS[arm]["num_iterations"]
        ratio = rep.completions_ratio(curve, budget, d)
        g_star = rep.break_even_interval(ratio, mu, 1.0, measured["old"])
        predicted = rep.predicted(measured["g"], mu, 1, 1.0, measured["old"])
        actual = summary["arms"][arm]["cpu_seconds"] / base_seconds
        mark = "*" if dict(curve)[budget] + d["high"] > curve[-1][1] else ""
        rows[arm] = {"ratio": ratio, "g_star": g_star, "at_g": rep.pays_at(measured["g"], g_star),
                     "predicted_time": predicted, "measured_time": actual}
        lines.append(f"| {arm} | {ratio['mean']:.2f} [{ratio['low']:.2f}, {ratio['high']:.2f}]{mark} | "
                     f"{rep.share(g_star['mean'])} [{rep.share(g_star['low'])}, "
                     f"{rep.share(g_star['high'])}] | "
                     f"{rows[arm]['at_g']} | {predicted:.2f}× | {actual:.2f}× |")
    lines += ["", f"μ = 1's mean curve (completions: accuracy, %): "
              + ", ".join(f"{c:,}: {rep.pct(a)}" for c, a in curve) + "."]
    return lines, {"measured": measured, "break_even": rows}


def per_pass_section(rows, runs, phase, chosen):
    lines = [f"## Per pass ({phase} seeds)", "",
             "Each μ > 1 arm at its rate: the clip fraction, the k3 estimate of KL(π_old ‖ π_θ) and the "
             "share "
             "of tokens with ρ outside [0.8, 1.2], by j = the updates made since the completions were "
             "sampled "
             "(j = 0: ρ = 1), means over every step of the runs.", "", *rep.PER_PASS_HEAD]
    summary = {}
    for arm in COMPARED:
        if arm not in chosen:
            continue
        d = rep.per_pass(runs, phase, arm, chosen[arm])
        summary[arm] = {"rate": chosen[arm], **d}
        lines.append(rep.per_pass_line(arm, chosen[arm], d))
    return lines, summary


def tuning_section(rows, runs, start):
    tuning = pr.tuning_scores(rows)
    rates = sorted({lr for by_lr in tuning.values() for lr in by_lr})
    chosen = pr.chosen_rates(rows)
    lines = [f"## Tuning (seeds {', '.join(map(str, pr.SEEDS['tune']))}): held-out accuracy (%) at "
             f"{pr.BUDGET * pr.STEP_SIZE:,} completions, the mean over the seeds finished; the best in bold",
             "",
             "| arm | " + " | ".join(f"{lr:g}" for lr in rates) + " | chosen |",
             "|---|" + "---|" * (len(rates) + 1)]
    summary = {}
    for arm in pr.ARMS:
        at = {lr: statistics.mean(s.values()) for lr, s in tuning.get(arm, {}).items()}
        if not at:
            continue
        best = max(at, key=at.get)
        cells = []
        for lr in rates:
            text = ""
            if lr in at:
                text = rep.pct(at[lr])
                if lr == best:
                    text = f"**{text}**"
                if len(tuning[arm][lr]) < len(pr.SEEDS["tune"]):
                    text += f" (n = {len(tuning[arm][lr])})"
                fallen = sum(rep.collapsed(v, start) for v in tuning[arm][lr].values())
                if fallen:
                    text += f", {fallen} collapsed"
            cells.append(text)
        picked = "not yet"
        if arm in chosen:
            picked = f"{chosen[arm]:g}"
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {picked} |")
        summary[arm] = {f"{lr:g}": at[lr] for lr in at}
    return lines, {"tuning": summary, "chosen": chosen}


# ---- The chart -------------------------------------------------------------------------------------------
def draw(runs, phase, chosen, start, path):
    """Held-out accuracy against completions, optimizer steps and training CPU seconds: each arm at its
    chosen rate (its best so far while tuning), the mean over the phase's seeds, shaded its 95 %
    t-interval."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.8), sharey=True)
    for arm, lr in chosen.items():
        mu = pr.ARMS[arm]["num_iterations"]
        points = [(0, 0, 0.0, start, start, start)]
        for k in pr.EVALS:
            values = list(by_seed(runs, phase, arm, lr, k).values())
            seconds = list(by_seed(runs, phase, arm, lr, k, "cpu_seconds").values())
            if len(values) >= 2:
                stat = rep.t_interval(values)
                points.append((k * pr.STEP_SIZE, k * mu, statistics.median(seconds), stat["mean"],
                               stat["low"],
                               stat["high"]))
        completions, steps, seconds, means, lows, highs = zip(*points)
        line = None
        for ax, x in zip(axes, (completions, steps, seconds)):
            if line is None:
                line, = ax.plot(x, means, marker="o", label=f"{arm} (lr {lr:g})")
            else:
                ax.plot(x, means, marker="o", color=line.get_color())
            ax.fill_between(x, lows, highs, color=line.get_color(), alpha=0.15)
    for ax, label in zip(axes, ("completions generated", "optimizer steps",
                                "training CPU seconds (median over seeds)")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out exact match, sampled at T = 1")
    axes[0].legend(fontsize=8)
    figure.suptitle(f"Arithmetic progressions (31-39-token answers), {phase} seeds: the mean, shaded "
                    f"its 95 % "
                    "t-interval", fontsize=10)
    rep.save(figure, path, 100)


def report(rows_path, folder, results):
    rows, runs, start = rep.load(rows_path, START)
    phases = sorted({k[0] for k in runs})
    lines = ["# Arithmetic progressions: what μ buys where generating dominates, the report", "",
             f"Setting: docs/progression/plan.md. Starting model: {rep.pct(start)} % held-out sampled exact "
             f"match. Rows: {len(rows)}, finished runs: {len(runs)} "
             f"({', '.join(f'{p} {sum(k[0] == p for k in runs)}' for p in phases)}); code "
             f"{', '.join(sorted({r['code'] for r in rows}))}.", ""]
    summary = {"start": start}
    chosen = pr.chosen_rates(rows)
    phase = "tune"
    if any(k[0] == "confirm" for k in runs) and set(chosen) == set(pr.ARMS):
        phase = "confirm"
        part, more = confirmation_section(rows, runs, start)
        lines += part + [""]
        summary["confirmation"] = more
        part, more = timing_section(runs, more)
        lines += part + [""]
        summary.update(more)
    else:
        lines += ["No confirmation run has finished: the tuning phase alone, a first look (not the verdict).",
                  ""]
    shown = chosen
    if phase == "tune":
        tuning = pr.tuning_scores(rows)
        shown = {arm: max(by_lr, key=lambda lr: statistics.mean(by_lr[lr].values()))
                 for arm, by_lr in tuning.items()}
    part, more = per_pass_section(rows, runs, phase, shown)
    lines += part + [""]
    summary["per_pass"] = more
    part, more = tuning_section(rows, runs, start)
    lines += part + [""]
    summary.update(more)
    rep.write(lines, summary, rows_path, folder, results)
    if shown:
        draw(runs, phase, shown, start, os.path.join(folder, "accuracy.png"))
    return "\n".join(lines)


def main(argv=None):
    opts = rep.arguments(argv, __doc__, pr.ROWS, pr.FOLDER, pr.RESULTS)
    print(report(opts.rows, opts.folder, opts.results))


if __name__ == "__main__":
    main()
