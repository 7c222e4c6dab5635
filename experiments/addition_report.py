"""
The report of experiments/addition.py's rows (docs/addition/plan.md says what it computes and why).

    python -m experiments.addition_report [runs/addition/rows.jsonl]

writes table.md and accuracy.png into docs/addition, and rows.jsonl (a copy of the rows it read) and
summary.json into experiments/addition_results. Before any confirmation row it reports the tuning phase
alone (and says so); the verdict comes from the confirmation rows only.
"""
import argparse, json, math, os, shutil, statistics

from experiments import addition as ad

START = os.path.join(ad.MODEL, "start.json")
COMPARED = [("μ=2", "μ=1"), ("μ=4", "μ=1"), ("μ=8", "μ=1"), ("S=4", "μ=1"), ("μ=4 no clip", "μ=4")]
MARGIN = 0.03  # the plan's equivalence margin, in accuracy
G_SHARES = (0.5, 0.9)  # generation's share of a μ = 1 step on other machines: the cost model's predictions


# ---- Statistics -----------------------------------------------------------------------------------------
def t_tail(x, df, n=2000):
    """P(T > x) for Student's t with df degrees of freedom and x > 0: the density integrated from x to
    infinity by Simpson's rule, over s = x / u from 0 to 1, so that a small tail keeps its precision."""
    norm = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))

    def integrand(s):  # the density at u = x / s times |du/ds|; at s = 0, its limit
        if s == 0:
            return 1 / x if df == 1 else 0.0
        return (1 + (x / s) ** 2 / df) ** (-(df + 1) / 2) * x / (s * s)

    h = 1 / n
    total = integrand(0) + integrand(1) + sum((4 if i % 2 else 2) * integrand(i * h) for i in range(1, n))
    return norm * total * h / 3


def t_quantile(p, df):
    """The p-quantile (p > 0.5) of Student's t with df degrees of freedom, found by bisection on t_tail."""
    low, high = 0.0, 1.0
    while t_tail(high, df) > 1 - p:
        high *= 2
    for _ in range(50):
        mid = (low + high) / 2
        if t_tail(mid, df) > 1 - p:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def t_interval(values, level=0.95):
    """{"mean", "low", "high", "median", "n", "p"}: the mean with its t-interval (n - 1 degrees of freedom),
    and the two-sided p-value of a mean of 0."""
    n, mean = len(values), statistics.mean(values)
    ad.require(n >= 2, f"a t-interval needs two values or more, got {n}")
    error = statistics.stdev(values) / math.sqrt(n)
    ad.require(error > 0, "a t-interval needs values that differ")
    half = t_quantile((1 + level) / 2, n - 1) * error
    p = 1.0  # a mean of exactly 0: t_tail needs x > 0
    if mean != 0:
        p = min(1.0, 2 * t_tail(abs(mean) / error, n - 1))
    return {"mean": mean, "low": mean - half, "high": mean + half, "median": statistics.median(values),
            "n": n, "p": p}


def paired(a, b, level=0.95):
    """t_interval of a[s] - b[s] over the seeds that both have."""
    seeds = sorted(set(a) & set(b))
    return t_interval([a[s] - b[s] for s in seeds], level)


def holm(p, alpha=0.05):
    """Holm's correction of a family of p-values {key: p}: {key: {"p_holm", "level"}}. The k-th smallest of
    m p-values is tested at alpha / (m - k + 1), and its adjusted p-value is the largest (m - j + 1) p_j
    for j up to k. Its interval's level is 1 - alpha / (m - k + 1) up to the first p-value that Holm does
    not reject, and that one's level from there on: an interval leaves out 0 exactly where p_holm < alpha."""
    order = sorted(p, key=p.get)
    out, adjusted, divisor, held = {}, 0.0, len(order), False
    for k, key in enumerate(order):
        adjusted = max(adjusted, min(1.0, (len(order) - k) * p[key]))
        if not held:
            divisor = len(order) - k
        held = held or adjusted >= alpha
        out[key] = {"p_holm": adjusted, "level": 1 - alpha / divisor}
    return out


def corrected(pairs, alpha=0.05):
    """A family of paired comparisons {key: (a, b)}, a and b {seed: value}, corrected by Holm: each key's
    paired interval at its Holm level, with "p_holm", "level" and "uncorrected", its 1 - alpha interval."""
    uncorrected = {key: paired(a, b, 1 - alpha) for key, (a, b) in pairs.items()}
    out = {}
    for key, step in holm({key: stat["p"] for key, stat in uncorrected.items()}, alpha).items():
        a, b = pairs[key]
        out[key] = {**paired(a, b, step["level"]), **step, "uncorrected": uncorrected[key]}
    return out


def reading(diff, margin=MARGIN):
    """The plan's words for a paired interval."""
    if diff["low"] > 0:
        return "higher"
    if diff["high"] < 0:
        return "lower"
    if -margin < diff["low"] and diff["high"] < margin:
        return "no difference (inside ±3 points)"
    return "inconclusive"


def latest_phase(runs):
    """"confirm" once a confirmation run has finished, else "tune"."""
    if any(key[0] == "confirm" for key in runs):
        return "confirm"
    return "tune"


def collapsed(accuracy, start):
    return accuracy < start / 2


# ---- The rows ---------------------------------------------------------------------------------------------
def at_budget(run, batches, step_size=ad.STEP_SIZE):
    """The run's row after `batches` mini-batches of `step_size` completions (64 here); None if the run has no
    evaluation there."""
    for r in run:
        if r["completions"] == batches * step_size:
            return r
    return None


def by_seed(runs, phase, arm, lr, batches, field="accuracy", step_size=ad.STEP_SIZE):
    """{seed: the field at `batches`} of the phase's finished runs of (arm, lr) that went that far (a bridge
    or confirmation run stops at the largest budget that chose its rate)."""
    found = {}
    for (p, a, r, seed), run in runs.items():
        row = at_budget(run, batches, step_size)
        if (p, a, r) == (phase, arm, lr) and row is not None:
            found[seed] = row[field]
    return found


def pct(x):
    return f"{100 * x:.1f}"


def fmt(stat, signed=False):
    sign = "+" if signed else ""
    return (f"{100 * stat['mean']:{sign}.1f} [{100 * stat['low']:{sign}.1f}, {100 * stat['high']:{sign}.1f}]")


PER_PASS_HEAD = ["| arm | rate | clip by j (%) | KL k3 by j (×1e-3) | outside by j (%) |",
                 "|---|---|---|---|---|"]


def per_pass(runs, phase, arm, lr):
    """Means by j (updates since sampling) of the clip fraction, k3 KL and the share outside [0.8, 1.2]
    over the phase's finished runs of (arm, lr), every row weighted alike."""
    out = {}
    for field in ("clip", "kl", "outside"):
        columns = [r[field] for (p, a, x, _), run in runs.items() if (p, a, x) == (phase, arm, lr)
                   for r in run]
        out[field] = []
        for j in range(ad.cycle(arm)[1]):
            out[field].append(statistics.mean(c[j] for c in columns if c[j] is not None))
    return out


def per_pass_line(arm, lr, d):
    """The per-pass table's line of (arm, lr), d from per_pass."""
    return (f"| {arm} | {lr:g} | " + ", ".join(pct(x) for x in d["clip"]) + " | "
            + ", ".join(f"{1e3 * x:.2f}" for x in d["kl"]) + " | " + ", ".join(pct(x) for x in d["outside"])
            + " |")


# ---- The tables -----------------------------------------------------------------------------------------
def tuning_section(rows, runs, start):
    tuning, seeds = ad.scores(rows, "tune"), ad.SEEDS["tune"]
    chosen = ad.chosen_rates(rows)
    lines = [f"## Tuning (seeds {seeds[0]}-{seeds[-1]}): mean held-out accuracy (%) per rate; the best in "
             "bold", ""]
    rates = sorted({lr for by_lr in tuning.values() for lr in by_lr})
    lines += ["| arm | budget | " + " | ".join(f"{lr:g}" for lr in rates) + " | inside |",
              "|---|---|" + "---|" * len(rates) + "---|"]
    summary = {}
    for arm in ad.ARMS:
        grid = ad.tuning_grid(arm, rows)
        for b in ad.BUDGETS:
            by_lr = tuning.get((arm, b), {})
            at = {lr: statistics.mean(s.values()) for lr, s in by_lr.items()}  # the seeds finished so far
            if not at:
                continue
            best = max(at, key=at.get)
            cells = []
            for lr in rates:
                if lr not in at:
                    cells.append("")
                    continue
                text = pct(at[lr])
                if lr == best:
                    text = f"**{text}**"
                if len(by_lr[lr]) < len(seeds):
                    text += f" (n = {len(by_lr[lr])})"
                cells.append(text)
            inside = "not yet"
            if (arm, b) in chosen:
                inside = "yes"
            if (arm, b) in chosen and arm in ad.SAME_RATE:
                inside = f"yes; confirmed at {ad.SAME_RATE[arm]}'s rate"
            lines.append(f"| {arm} | {b * ad.STEP_SIZE:,} | " + " | ".join(cells) + f" | {inside} |")
            summary[f"{arm} @ {b * ad.STEP_SIZE}"] = {"means": {f"{lr:g}": at[lr] for lr in at},
                                                     "best": best, "grid": grid}
    lines += ["", f"Collapse share (held-out accuracy below {pct(start / 2)} %, half the start's) at 8,192 "
              "completions, per rate, over the finished tuning seeds:", "",
              "| arm | " + " | ".join(f"{lr:g}" for lr in rates) + " |", "|---|" + "---|" * len(rates)]
    shares = {}
    for arm in ad.ARMS:
        cells = []
        for lr in rates:
            scores = by_seed(runs, "tune", arm, lr, max(ad.BUDGETS))
            if scores:
                share = sum(collapsed(s, start) for s in scores.values()) / len(scores)
                shares[f"{arm} @ {lr:g}"] = share
                cells.append(f"{sum(collapsed(s, start) for s in scores.values())}/{len(scores)}")
            else:
                cells.append("")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Per pass, at each arm's best tuning rate for 8,192 completions (tuning seeds): the clip "
              "fraction, the k3 estimate of KL(π_old ‖ π_θ) and the share of tokens with ρ outside "
              "[0.8, 1.2], by j = the updates made since the completions were sampled (j = 0: ρ = 1)", "",
              *PER_PASS_HEAD]
    for arm in ad.ARMS:
        by_lr = tuning.get((arm, max(ad.BUDGETS)), {})
        at = {lr: statistics.mean(s.values()) for lr, s in by_lr.items()}  # the seeds finished so far
        if not at:
            continue
        best = max(at, key=at.get)
        lines.append(per_pass_line(arm, best, per_pass(runs, "tune", arm, best)))
    return lines, {"tuning": summary, "tuning_collapse": shares}


def signed(stat):
    """A paired difference in points: mean [low, high]."""
    return fmt(stat, signed=True)


def confirmation_section(rows, runs, start):
    """Each (arm, budget) at its chosen rate, sampled and greedy, and the ten comparisons of each, corrected
    by Holm within each metric's family of ten; and the margin against μ = 1's gain from the start."""
    chosen, seeds = ad.chosen_rates(rows), ad.SEEDS["confirm"]
    lines = [f"## Confirmation (seeds {seeds[0]}-{seeds[-1]}): each (arm, budget) at its chosen rate", "",
             "Held-out accuracy (%), sampled at T = 1 (the plan's score): mean [95 % t-interval], median, "
             "collapse share; greedy (T = 1e-4, the plan's secondary metric, never used to choose): mean. "
             "Δ: the paired difference from the arm it is compared with, at the same budget, mean [paired "
             "t-interval] in points. Each metric's ten comparisons are corrected by Holm's step-down method "
             "(the k-th smallest p-value's interval at 1 − 0.05/(10 − k + 1), held from the first that Holm "
             "does not reject); the uncorrected 95 % interval beside. The reading applies the ±3-point "
             "margin to the corrected interval.", "",
             "| arm | budget | rate | seeds | sampled | median | collapsed | Δ sampled, Holm | Δ uncorrected "
             "| Δ median | reading | greedy | Δ greedy, Holm | Δ greedy uncorrected | greedy reading |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    values, families = {}, {}
    for field in ("accuracy", "greedy"):
        for (arm, b), lr in chosen.items():
            values[field, arm, b] = by_seed(runs, "confirm", arm, lr, b, field)
        pairs = {}
        for arm, versus in COMPARED:
            for b in ad.BUDGETS:
                a, base = values.get((field, arm, b), {}), values.get((field, versus, b), {})
                if len(set(a) & set(base)) >= 2:
                    pairs[arm, b] = (a, base)
        families[field] = corrected(pairs)
    summary = {}
    for b in ad.BUDGETS:
        for arm in ad.ARMS:
            sampled = values.get(("accuracy", arm, b), {})
            if len(sampled) < 2:
                continue
            stat = t_interval(list(sampled.values()))
            fallen = sum(collapsed(v, start) for v in sampled.values())
            entry = {"rate": chosen[arm, b], **stat, "collapsed": fallen,
                     "greedy": statistics.mean(values["greedy", arm, b].values())}
            cells = ["—"] * 4
            if (arm, b) in families["accuracy"]:
                diff = families["accuracy"][arm, b]
                entry["vs"] = {"arm": dict(COMPARED)[arm], **diff, "reading": reading(diff)}
                cells = [signed(diff) + f" vs {dict(COMPARED)[arm]}", signed(diff["uncorrected"]),
                         f"{100 * diff['median']:+.1f}", reading(diff)]
            greedy_cells = ["—"] * 3
            if (arm, b) in families["greedy"]:
                diff = families["greedy"][arm, b]
                entry["greedy_vs"] = {"arm": dict(COMPARED)[arm], **diff, "reading": reading(diff)}
                greedy_cells = [signed(diff), signed(diff["uncorrected"]), reading(diff)]
            summary[f"{arm} @ {b * ad.STEP_SIZE}"] = entry
            lines.append(f"| {arm} | {b * ad.STEP_SIZE:,} | {chosen[arm, b]:g} | {stat['n']} | {fmt(stat)} | "
                         f"{pct(stat['median'])} | {fallen}/{stat['n']} | " + " | ".join(cells)
                         + f" | {pct(entry['greedy'])} | " + " | ".join(greedy_cells) + " |")
    margin = margin_against_gain(summary, start)
    if margin:
        lines += ["", "The ±3-point margin against μ = 1's own gain from the starting model: "
                  + "; ".join(f"{int(b):,} completions, a gain of {100 * m['gain']:.1f} points, the margin "
                              f"{100 * m['share']:.0f} % of it" for b, m in margin.items()) + "."]
    return lines, {"confirmation": summary, "margin": margin}


def margin_against_gain(confirmation, start, margin=MARGIN):
    """{budget: {"gain": μ = 1's mean accuracy there minus the start's, "share": the margin / that gain}}
    for the budgets where μ = 1 has a confirmation entry."""
    out = {}
    for b in ad.BUDGETS:
        entry = confirmation.get(f"μ=1 @ {b * ad.STEP_SIZE}")
        if entry is not None:
            gain = entry["mean"] - start
            out[str(b * ad.STEP_SIZE)] = {"gain": gain, "share": margin / gain}
    return out


# ---- In TRL PR #2899's terms: completions, and the generation share where an arm pays -----------------
G_ASKED = 0.9  # a machine where generating takes 90 % of a μ = 1 step, as on a GPU with HF generate
R_ENDS = {"S=4": (1.0, 0.25)}  # S = 4's larger generation call: compute-bound (r = 1) to launch-bound (1/4)


def interpolate(points, x):
    """y at x on the polyline through points [(x, y)], x rising: linear between the two points around x,
    and beyond the ends along the first or the last segment."""
    ad.require(all(p[0] < q[0] for p, q in zip(points, points[1:])), "interpolate needs a rising x")
    i = 0
    while i < len(points) - 2 and x > points[i + 1][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i], points[i + 1]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


def completions_ratio(curve, budget, diff):
    """{"mean", "low", "high"}: the completions that μ = 1 needs on its mean curve [(completions, accuracy)]
    to reach its accuracy at `budget` plus the paired difference (its mean and its interval's ends), over
    the budget. log2(completions) is linear in accuracy between two evaluations, and beyond the curve's
    ends it follows its first or last segment."""
    inverse = [(accuracy, math.log2(c)) for c, accuracy in curve]
    at = dict(curve)[budget]
    return {k: 2 ** interpolate(inverse, at + diff[k]) / budget for k in ("mean", "low", "high")}


def break_even_share(ratio, mu, r, old):
    """g*: the generation share of a μ = 1 step at which the arm's time per completion, predicted(g*, ...),
    equals `ratio` (μ = 1's completions needed, over the arm's); the arm pays per second above it."""
    return (mu + old - ratio) / (mu + old - r)


def break_even_interval(ratio, mu, r, old):
    """g* {"mean", "low", "high"} of the completions ratio {"mean", "low", "high"}: the more completions μ = 1
    needs, the lower g*, so the ratio's high end gives g*'s low end."""
    return {"mean": break_even_share(ratio["mean"], mu, r, old),
            "low": break_even_share(ratio["high"], mu, r, old),
            "high": break_even_share(ratio["low"], mu, r, old)}


def seeds_to_decide(diff, threshold):
    """About how many seeds the paired interval `diff` needs to leave out `threshold`, its half width
    shrinking as 1/√n while its mean, its spread and its level stay as they are."""
    half = (diff["high"] - diff["low"]) / 2
    return math.ceil(diff["n"] * (half / abs(diff["mean"] - threshold)) ** 2)


def pays_at(g, g_star):
    """The reading of a machine's g against g* {"mean", "low", "high"}."""
    if g > g_star["high"]:
        return "pays"
    if g < g_star["low"]:
        return "does not pay"
    return "undecided"


def share(x):
    """g* as a share: above 1 no machine reaches it, below 0 every one does."""
    if x >= 1:
        return "≥ 1"
    if x <= 0:
        return "≤ 0"
    return f"{x:.2f}"


def mean_curve(runs, arm, lr, evals=ad.EVALS, step_size=ad.STEP_SIZE):
    """[(completions, mean held-out sampled accuracy)] of the arm's confirmation runs at lr, at every
    evaluation (after `evals` mini-batches of `step_size` completions) that two seeds or more reached."""
    curve = []
    for k in evals:
        values = by_seed(runs, "confirm", arm, lr, k, step_size=step_size)
        if len(values) >= 2:
            curve.append((k * step_size, statistics.mean(values.values())))
    return curve


def break_even_section(rows, runs, confirmation, old):
    """For each arm against μ = 1 and each budget: the completions that μ = 1 needs to match the arm, as a
    ratio with the interval of the Holm-corrected paired difference carried through μ = 1's mean curve, and
    from it the generation share g* above which the arm pays per second, by the cost model with the π_old
    pass at `old` of an update."""
    chosen = ad.chosen_rates(rows)
    lines = ["## In TRL PR #2899's terms: the completions μ = 1 needs, and the generation share g* where "
             "an arm pays", "",
             "c: the completions that μ = 1 needs to reach each arm's mean accuracy, over the arm's, read on "
             "μ = 1's mean curve (confirmation seeds, at its rate for the budget, evaluated at 256 to 8,192 "
             "completions) with log2(completions) linear in accuracy between evaluations; above 8,192 (*) "
             "the last doubling's slope is extended, an extrapolation. Its interval carries the ends of the "
             "Holm-corrected paired interval through the same curve, which is taken as exact. The cost "
             "model gives an arm's time per completion against μ = 1's as g·r + (1 − g)(μ + l), g being "
             f"generation's share of a μ = 1 step and l = {old:.2f} the π_old pass against an update, as "
             "measured here; so the arm pays per second where g > g* = (μ + l − c)/(μ + l − r), with r = 1, "
             "or for S = 4 from 1 (compute-bound) to 1/4 (launch-bound). Seeds to decide: about how many "
             f"paired seeds would put g = {G_ASKED} outside g*'s interval, if the mean, the spread and the "
             "level stayed as they are.", "",
             f"| arm | r | budget | Δ sampled, Holm | c [interval] | g* [interval] | at g = {G_ASKED} | "
             "seeds to decide |", "|---|---|---|---|---|---|---|---|"]
    found = []
    for b in ad.BUDGETS:
        completions = b * ad.STEP_SIZE
        curve = mean_curve(runs, "μ=1", chosen["μ=1", b])
        at, top = dict(curve)[completions], curve[-1][1]
        forward = [(math.log2(c), accuracy) for c, accuracy in curve]
        for arm in ad.ARMS:
            entry = confirmation.get(f"{arm} @ {completions}", {})
            diff = entry.get("vs")
            if diff is None or diff["arm"] != "μ=1":
                continue
            ratio = completions_ratio(curve, completions, diff)
            mu = ad.ARMS[arm]["num_iterations"]
            beyond = at + diff["high"] > top
            for r in R_ENDS.get(arm, (1.0,)):
                g_star = break_even_interval(ratio, mu, r, old)
                reading_there = pays_at(G_ASKED, g_star)
                needed = "—"
                if reading_there == "undecided":
                    asked = predicted(G_ASKED, mu, ad.cycle(arm)[0], r, old)
                    threshold = interpolate(forward, math.log2(asked * completions)) - at
                    needed = seeds_to_decide(diff, threshold)
                found.append({"arm": arm, "r": r, "completions": completions, "ratio": ratio,
                              "g_star": g_star, "at": {"g": G_ASKED, "reading": reading_there,
                                                       "seeds_to_decide": needed},
                              "extrapolated": beyond})
                mark = "*" if beyond else ""
                lines.append(f"| {arm} | {r:g} | {completions:,} | {signed(diff)} | {ratio['mean']:.2f} "
                             f"[{ratio['low']:.2f}, {ratio['high']:.2f}]{mark} | {share(g_star['mean'])} "
                             f"[{share(g_star['low'])}, {share(g_star['high'])}] | {reading_there} | "
                             f"{needed} |")
    curve = mean_curve(runs, "μ=1", chosen["μ=1", max(ad.BUDGETS)])
    lines += ["", f"μ = 1's mean curve at {chosen['μ=1', max(ad.BUDGETS)]:g} (completions: held-out sampled "
              "accuracy, %): " + ", ".join(f"{c:,}: {pct(accuracy)}" for c, accuracy in curve)
              + f"; its last doubling {100 * (curve[-1][1] - curve[-2][1]):+.1f} points."]
    return lines, {"break_even": {"l": old, "rows": found}}


def per_step_section(rows, runs):
    """The plan's secondary reading: each arm at its rate for a budget, read after as many optimizer steps as
    μ = 1 takes to spend that budget (so after fewer completions where μ > 1), paired against μ = 1, the ten
    comparisons corrected by Holm."""
    chosen = ad.chosen_rates(rows)
    lines = ["## Per optimizer step (a secondary reading: the rates were tuned per completion)", "",
             "Each arm at its rate for a budget, read after the optimizer steps that μ = 1 takes to spend it "
             "(μ > 1 has then generated 1/μ of the completions); held-out sampled accuracy (%), mean [95 % "
             "t-interval], and the paired difference from μ = 1 at the same steps, its ten comparisons "
             "corrected by Holm (as above), the uncorrected 95 % interval beside.", "",
             "| arm | steps | rate | completions | seeds | accuracy | Δ vs μ=1, Holm | Δ uncorrected "
             "| reading |",
             "|---|---|---|---|---|---|---|---|---|"]
    values, pairs = {}, {}
    for b in ad.BUDGETS:
        base = by_seed(runs, "confirm", "μ=1", chosen["μ=1", b], b)
        for arm in ad.ARMS:
            batches = b // ad.ARMS[arm]["num_iterations"]
            values[arm, b] = by_seed(runs, "confirm", arm, chosen[arm, b], batches)
            if arm != "μ=1" and len(set(values[arm, b]) & set(base)) >= 2:
                pairs[arm, b] = (values[arm, b], base)
    diffs = corrected(pairs)
    summary = {}
    for b in ad.BUDGETS:
        for arm in ad.ARMS:
            batches = b // ad.ARMS[arm]["num_iterations"]
            if len(values[arm, b]) < 2:
                continue
            stat = t_interval(list(values[arm, b].values()))
            entry = {"rate": chosen[arm, b], "completions": batches * ad.STEP_SIZE, **stat}
            diff_text = ["—"] * 3
            if (arm, b) in diffs:
                diff = diffs[arm, b]
                entry["vs μ=1"] = {**diff, "reading": reading(diff)}
                diff_text = [signed(diff), signed(diff["uncorrected"]), reading(diff)]
            summary[f"{arm} @ step {b}"] = entry
            lines.append(f"| {arm} | {b} | {chosen[arm, b]:g} | {batches * ad.STEP_SIZE:,} | {stat['n']} | "
                         f"{fmt(stat)} | " + " | ".join(diff_text) + " |")
    return lines, {"per_step": summary}


def per_pass_section(rows, runs):
    """The clip and the drift from π_old by pass, on the confirmation seeds, each arm at its rate for the
    largest budget (the clip-off arm at μ = 4's)."""
    chosen = ad.chosen_rates(rows)
    lines = ["## Per pass (confirmation seeds)", "",
             "Each arm at its rate for 8,192 completions: the clip fraction, the k3 estimate of "
             "KL(π_old ‖ π_θ) and the share of tokens with ρ outside [0.8, 1.2], by j = the updates made "
             "since the completions were sampled (j = 0: ρ = 1), means over every step of the runs.", "",
             *PER_PASS_HEAD]
    summary = {}
    for arm in ad.ARMS:
        lr = chosen[arm, max(ad.BUDGETS)]
        d = per_pass(runs, "confirm", arm, lr)
        summary[arm] = {"rate": lr, **d}
        lines.append(per_pass_line(arm, lr, d))
    return lines, {"per_pass": summary}


def bridge_section(rows, runs):
    """Seed 1 at the chosen rates, tuning's code against the confirmation's."""
    lines = ["## Bridge: tuning seed 1 again with the confirmation's code", "",
             "| arm | rate | budget | tuning | bridge | difference |", "|---|---|---|---|---|---|"]
    pairs = sorted({(arm, lr) for (arm, _), lr in ad.chosen_rates(rows).items()})
    found = False
    for arm, lr in pairs:
        for b in ad.BUDGETS:
            then, now = (by_seed(runs, phase, arm, lr, b).get(1) for phase in ("tune", "bridge"))
            if then is not None and now is not None:
                found = True
                lines.append(f"| {arm} | {lr:g} | {b * ad.STEP_SIZE:,} | {pct(then)} | {pct(now)} | "
                             f"{100 * (now - then):+.1f} |")
    return lines if found else []


def predicted(g, mu, S, r, old=1 / 3):
    """A mini-batch's time against μ = 1's (the plan's cost model): generation g·r, μ updates, and where
    μ·S > 1 the π_old pass, `old` of an update (the plan's third, unless measured)."""
    if mu * S == 1:
        return 1.0
    return g * r + (1 - g) * (mu + old)


def seconds_section(rows, runs):
    """Median training seconds to spend each budget, as measured, and the cost model's predictions."""
    phase, chosen = latest_phase(runs), ad.chosen_rates(rows)
    lines = [f"## Per second ({phase} rows)", "",
             "Median training seconds to spend each budget on one core of a 2-core AMD EPYC shared with "
             "other work, torch 2.13.0 for CPU, "
             "measured as the process's CPU time (which other work on the core does not lengthen; rows "
             "without it: wall time), without scoring and diagnostics; then the cost model's time relative "
             "to μ = 1 "
             "for a machine where generating takes a share g of a μ = 1 step, predictions: "
             "g·r + (1 − g)(μ + 1/3) where μ·S > 1, r = 1 but for S = 4, where r = 1/4 (a 4× larger "
             "generation call as long as one: launch-bound) to 1 (compute-bound).", "",
             "| arm | " + " | ".join(f"{b * ad.STEP_SIZE:,} (s)" for b in ad.BUDGETS) + " | "
             + " | ".join(f"g = {g} (predicted)" for g in G_SHARES) + " |",
             "|---|" + "---|" * (len(ad.BUDGETS) + len(G_SHARES))]
    summary = {}
    for arm in ad.ARMS:
        medians = []
        for b in ad.BUDGETS:
            rate = chosen.get((arm, b))  # confirmation: the runs at the budget's rate; tuning: every rate
            values = [r.get("cpu_seconds", r["seconds"]) for (p, a, lr, _), run in runs.items()
                      if (p, a) == (phase, arm) and (phase == "tune" or lr == rate)
                      for r in run if r["completions"] == b * ad.STEP_SIZE]
            medians.append(statistics.median(values) if values else None)
        mu = ad.ARMS[arm]["num_iterations"]
        S = ad.cycle(arm)[0]
        fastest = [predicted(g, mu, S, 1 / S) for g in G_SHARES]
        slowest = [predicted(g, mu, S, 1.0) for g in G_SHARES]
        summary[arm] = {"median_seconds": medians, "predicted_relative": [fastest, slowest]}
        cells = []
        for low, high in zip(fastest, slowest):
            if low == high:
                cells.append(f"{low:.2f}×")
            else:
                cells.append(f"{low:.2f}× to {high:.2f}×")
        lines.append(f"| {arm} | " + " | ".join("" if m is None else f"{m:.1f}" for m in medians) + " | "
                     + " | ".join(cells) + " |")
    shares = measured_shares(runs, phase)
    if shares:
        lines += ["", "Measured there, from the trainer's seconds per phase (the sum over the phase's rows): "
                  f"generation's share of a μ = 1 step g = {shares['g']:.2f}; the π_old pass against μ = 1's "
                  f"update (forward, backward and optimizer) = {shares['old']:.2f}."]
        summary["measured"] = shares
    return lines, {"seconds": summary}


def measured_shares(runs, phase):
    """{"g": generating's share of μ = 1's phase seconds, "old": the π_old pass of the μ > 1 arms per
    mini-batch against μ = 1's update (forward, backward, optimizer) per mini-batch}, from the finished
    runs' `time`; {} without such runs."""
    update = ("forward", "backward", "optimizer")
    reused = [arm for arm in ad.ARMS if ad.cycle(arm)[0] == 1 and ad.cycle(arm)[1] > 1]
    sums = {"generate": 0.0, "update": 0.0, "batches": 0, "old": 0.0, "old_batches": 0}
    for (p, arm, _, _), run in runs.items():
        if p != phase or "time" not in run[-1]:
            continue
        batches = run[-1]["completions"] // ad.STEP_SIZE
        seconds = {}
        for r in run:
            for name, value in r["time"].items():
                seconds[name] = seconds.get(name, 0.0) + value
        if arm == "μ=1":
            sums["generate"] += seconds.get("generate", 0.0)
            sums["update"] += sum(seconds.get(n, 0.0) for n in update)
            sums["batches"] += batches
        if arm in reused:
            sums["old"] += seconds.get("logps", 0.0)
            sums["old_batches"] += batches
    if not sums["batches"] or not sums["old_batches"]:
        return {}
    per_update = sums["update"] / sums["batches"]
    return {"g": sums["generate"] / (sums["generate"] + sums["update"]),
            "old": sums["old"] / sums["old_batches"] / per_update}


# ---- The chart -------------------------------------------------------------------------------------------
def draw(rows, runs, start, path):
    """Held-out accuracy against completions generated (left) and against optimizer steps (right): each arm
    at its rate for 8,192 completions (its best so far while tuning), on the confirmation seeds if any,
    else the tuning seeds; the mean, with its 95 % t-interval where two seeds or more have finished."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phase = latest_phase(runs)
    by_lr = ad.scores(rows, "tune")
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    for arm in ad.ARMS:
        lr = ad.chosen_rates(rows).get((arm, max(ad.BUDGETS)))
        at = {x: statistics.mean(s.values()) for x, s in by_lr.get((arm, max(ad.BUDGETS)), {}).items()}
        if lr is None and at:  # tuning not over: its best so far
            lr = max(at, key=at.get)
        if lr is None:
            continue
        points = [(0, 0, start, start, start)]
        for k in ad.EVALS:
            values = list(by_seed(runs, phase, arm, lr, k).values())
            if len(values) >= 2:
                stat = t_interval(values)
                points.append((k * ad.STEP_SIZE, ad.steps_at(arm, k), stat["mean"], stat["low"],
                               stat["high"]))
            elif values:
                points.append((k * ad.STEP_SIZE, ad.steps_at(arm, k), values[0], values[0], values[0]))
        completions, steps, means, lows, highs = zip(*points)
        line, = left.plot(completions, means, marker="o", label=f"{arm} (lr {lr:g})")
        left.fill_between(completions, lows, highs, color=line.get_color(), alpha=0.15)
        right.plot(steps, means, marker="o", color=line.get_color())
        right.fill_between(steps, lows, highs, color=line.get_color(), alpha=0.15)
    left.set_xlabel("completions generated")
    right.set_xlabel("optimizer steps (log scale)")
    right.set_xscale("symlog", linthresh=4)
    left.set_ylabel("held-out exact match, sampled at T = 1")
    label = "confirmation seeds" if phase == "confirm" else "tuning seeds (a first look, not the verdict)"
    figure.suptitle(f"2-digit sums, each arm at its rate for 8,192 completions, {label}: the mean, shaded "
                    "its 95 % t-interval", fontsize=10)
    left.legend(fontsize=8)
    for axes in (left, right):
        axes.grid(alpha=0.3)
    save(figure, path, 110)


def report(rows_path, folder, results):
    rows, runs, start = load(rows_path, START)
    lines = ["# 2-digit sums: what μ buys, the report", "",
             f"Setting: docs/addition/plan.md. Starting model: {pct(start)} % held-out sampled exact match. "
             f"Rows: {len(rows)}, finished runs: {len(runs)} "
             f"({', '.join(sorted({f'{p} {sum(k[0] == p for k in runs)}' for p, *_ in runs}))}).", ""]
    summary = {"start": start}
    if latest_phase(runs) == "confirm":
        part, more = confirmation_section(rows, runs, start)
        old = measured_shares(runs, "confirm").get("old", 1 / 3)  # the plan's third where nothing was timed
        for part, more in ((part, more), break_even_section(rows, runs, more["confirmation"], old),
                           per_step_section(rows, runs), per_pass_section(rows, runs)):
            lines += part + [""]
            summary.update(more)
    else:
        lines += ["No confirmation run has finished: the tuning phase alone, a first look (not the verdict).",
                  ""]
    lines += bridge_section(rows, runs) + [""]
    for section in (tuning_section(rows, runs, start), seconds_section(rows, runs)):
        lines += section[0] + [""]
        summary.update(section[1])
    write(lines, summary, rows_path, folder, results)
    draw(rows, runs, start, os.path.join(folder, "accuracy.png"))
    return "\n".join(lines)


def load(rows_path, start_path):
    """A report's input: the rows, their finished runs, and the starting model's held-out sampled accuracy
    from its start.json."""
    rows = ad.read(rows_path)
    with open(start_path) as f:
        start = json.load(f)["sampled"]
    return rows, ad.finished_runs(rows), start


def save(figure, path, dpi):
    """A report's chart laid out, written to `path` and closed."""
    import matplotlib.pyplot as plt  # Imported here as in draw(), which has chosen the backend by now.
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)


def write(lines, summary, rows_path, folder, results):
    """A report's table.md into `folder`; its summary.json, and a copy of the rows it read, into `results`."""
    os.makedirs(folder, exist_ok=True)
    os.makedirs(results, exist_ok=True)
    if os.path.abspath(rows_path) != os.path.abspath(os.path.join(results, "rows.jsonl")):
        shutil.copyfile(rows_path, os.path.join(results, "rows.jsonl"))
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False, default=str)


def arguments(argv, description, rows, folder, results):
    """A report's command line: the rows it reads (unless given, rows.jsonl in the folder `rows`), and where
    its pages (`folder`) and its data (`results`) go."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="?", default=os.path.join(rows, "rows.jsonl"))
    p.add_argument("--folder", default=folder, help="where table.md and accuracy.png go")
    p.add_argument("--results", default=results, help="where rows.jsonl and summary.json go")
    return p.parse_args(argv)


def main(argv=None):
    opts = arguments(argv, __doc__, ad.ROWS, ad.FOLDER, ad.RESULTS)
    print(report(opts.rows, opts.folder, opts.results))


if __name__ == "__main__":
    main()
