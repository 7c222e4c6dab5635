"""
The report of experiments/fixed_budget.py's rows (docs/fixed-budget/): table.md, summary.json, rewards.png.

The verdict comes from the confirmation rows only: per (arm, budget) the mean held-out reward over the
confirmation seeds with a 95 % t-interval, and each arm's paired difference from μ = 1 at the same budget
with a 95 % paired t-interval (seed s of both arms shares its first prompts and samples). The tuning rows
give the chosen rates and the grids around them. The seconds each arm takes to spend a budget come from a
cost model with measured parts (docs/update-clock/benchmark-cpu.md, one core of a 2-core AMD EPYC;
docs/performance.md's H200 figures, a prediction). A difference whose interval holds 0 reads
"inconclusive".

    python -m experiments.report_fixed_budget [runs/fixed-budget/rows.jsonl]
    python -m experiments.report_fixed_budget docs/fixed-budget/rows.jsonl   # the committed study's table
"""
import json, math, os, statistics, sys, textwrap

from experiments import fixed_budget as fb
from experiments.addition_report import t_quantile

SETTING = ("SmolLM2-135M-Instruct on one CPU core, the length reward −|40 − len(completion)| on 40 TL;DR "
           "posts, scored on 8 held-out posts × 4 samples; 1 prompt × 8 completions per optimizer step, "
           "constant learning rate, each (arm, budget) at its tuned rate")
# The cost of a step, in parts of a μ = 1 step's seconds T1: g generating, l one π_old pass over a step's
# completions, r_4 a 4× larger generation batch's time ÷ one's. CPU: docs/update-clock/benchmark-cpu.md
# (this shape, one core of a 2-core AMD EPYC, 2026-12-01: T1 = 5.91 s, fixed-length decoding). GPU:
# docs/performance.md (an H200, random SmolLM2 weights, another shape: g = 2.24/3.16, l = 0.409/3.16); r_4
# was not measured there: 1 if decoding is launch-bound, as predicted, up to 4 if it is compute-bound.
CPU = "one EPYC core (measured parts)"
COSTS = {CPU: dict(g=0.431, l=0.161, r_4=2.209), "H200 (predicted, r_4 = 1)": dict(g=0.709, l=0.129, r_4=1.0)}


# ---- Statistics -----------------------------------------------------------------------------------------
def t_interval(values, level=0.95):
    """(mean, low, high, n): the mean and its t-interval (n - 1 degrees of freedom)."""
    n, mean = len(values), statistics.mean(values)
    fb.gm.require(n >= 2, f"a t-interval needs two values or more, got {n}")
    half = t_quantile((1 + level) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half, n


def paired(a, b):
    """t_interval of a[s] - b[s] over the seeds s that both have."""
    seeds = sorted(set(a) & set(b))
    return t_interval([a[s] - b[s] for s in seeds])


def seconds_to_spend(arm, budget, g, l, r_4):
    """The seconds an arm takes to generate `budget` completions and take every step they serve, in units
    of a μ = 1 step's: per generation batch, generating (g, × r_S for a larger one), a π_old pass per
    mini-batch where a batch serves more than one step (S·l), and μ·S training steps of (1 − g) each."""
    S = fb.ARMS[arm].get("steps_per_generation", 1)
    size, steps = fb.per_generation(arm)
    r = {1: 1.0, 4: r_4}[S]
    return budget / size * (g * r + (S * l if steps > 1 else 0.0) + steps * (1 - g))


def clip_fractions(runs):
    """{arm: mean clip fraction of its off-policy steps} (μ > 1: reuse steps; S = 4: later mini-batches)."""
    fractions = {}
    for (_, arm, _, _), run in runs.items():
        size, cycle = fb.per_generation(arm)
        fractions.setdefault(arm, []).extend(r["clip"] for r in run if (r["step"] - 1) % cycle)
    return {arm: statistics.mean(v) for arm, v in fractions.items() if v}


# ---- The report -----------------------------------------------------------------------------------------
def fmt(stat, digits=1):
    return f"{stat[0]:+.{digits}f} [{stat[1]:+.{digits}f}, {stat[2]:+.{digits}f}]"


def reading(stat):
    """What a paired difference's interval says: it holds 0 (inconclusive), or lies below or above it."""
    if stat[2] < 0:
        return "below μ = 1"
    if stat[1] > 0:
        return "above μ = 1"
    return "inconclusive"


def report(rows, folder):
    tuning, confirm = fb.scores(rows, "tune"), fb.scores(rows, "confirm")
    chosen = fb.choose_rates(tuning, fb.SEEDS["tune"])
    start = next((r["eval_reward"] for r in rows if r["step"] == 0), None)
    fb.gm.require(start is not None, "the rows hold no run yet: run python -m experiments.fixed_budget tune")
    lines = [f"Setting: {SETTING}. Untrained: {start:.1f}.", "", "## Tuning (seeds 42-47): mean held-out "
             "reward per rate; the chosen rate in bold", "", "| arm | budget | " + " | ".join(
                 f"{lr:g}" for lr in sorted({lr for v in tuning.values() for lr in v})) + " | inside |",
             "|---|---|" + "---|" * (len({lr for v in tuning.values() for lr in v}) + 1)]
    all_rates = sorted({lr for v in tuning.values() for lr in v})
    for arm in fb.ARMS:
        for b in fb.BUDGETS:
            by_lr, (best, inside) = tuning.get((arm, b), {}), chosen.get((arm, b), (None, False))
            cells = [("**{:.1f}**" if lr == best else "{:.1f}").format(statistics.mean(by_lr[lr].values()))
                     + ("" if len(by_lr[lr]) == len(fb.SEEDS["tune"]) else f" ({len(by_lr[lr])} seeds)")
                     if lr in by_lr else "" for lr in all_rates]
            lines.append(f"| {arm} | {b} | " + " | ".join(cells) + f" | {'yes' if inside else 'no'} |")
    summary = {"setting": SETTING, "untrained": start, "chosen_lr": {}, "confirm": {}, "vs_mu1": {},
               "clip": {}, "seconds": {}}
    lines += ["", "## Confirmation (fresh seeds): each (arm, budget) at its chosen rate", "",
              "mean [95 % t-interval] over the seeds; Δ: paired difference from μ = 1 at the same budget, "
              "[95 % paired t-interval] (six comparisons, no correction for multiplicity)", "",
              "| arm | budget | rate | seeds | held-out reward | Δ vs μ = 1 | reading |",
              "|---|---|---|---|---|---|---|"]
    for b in fb.BUDGETS:
        base = confirm.get(("μ=1", b), {}).get(chosen.get(("μ=1", b), (None,))[0], {})
        for arm in fb.ARMS:
            lr = chosen.get((arm, b), (None,))[0]
            seeds = confirm.get((arm, b), {}).get(lr, {})
            if len(seeds) < 2:
                continue
            stat = t_interval(list(seeds.values()))
            delta = paired(seeds, base) if arm != "μ=1" and len(set(seeds) & set(base)) >= 2 else None
            lines.append(f"| {arm} | {b} | {lr:g} | {stat[3]} | {fmt(stat)} | "
                         f"{fmt(delta) if delta else '—'} | {reading(delta) if delta else '—'} |")
            key = f"{arm}@{b}"
            summary["chosen_lr"][key], summary["confirm"][key] = lr, stat
            if delta:
                summary["vs_mu1"][key] = delta
    seeds = fb.SEEDS["confirm"]  # every score, to see what a mean hides (a run that collapsed)
    lines += ["", "Each confirmation run's held-out reward, by its random seed:", "",
              "| arm | budget | " + " | ".join(map(str, seeds)) + " |", "|---|---|" + "---|" * len(seeds)]
    for b in fb.BUDGETS:
        for arm in fb.ARMS:
            by_seed = confirm.get((arm, b), {}).get(chosen.get((arm, b), (None,))[0], {})
            lines.append(f"| {arm} | {b} | " + " | ".join(f"{by_seed[s]:.1f}" if s in by_seed else ""
                                                          for s in seeds) + " |")
    clips = clip_fractions({k: v for k, v in fb.finished_runs(rows).items() if k[0] == "confirm"})
    summary["clip"] = clips
    lines += ["", "Clip fraction of the off-policy steps (confirmation runs; μ > 1: reuse steps, S = 4: "
              "later mini-batches): " + ", ".join(f"{a} {c:.0%}" for a, c in sorted(clips.items())) + "."]
    lines += ["", "## Seconds to spend each budget, in μ = 1 steps (cost model, see the docstring)", "",
              "| where | " + " | ".join(f"{a} at {b}" for b in fb.BUDGETS for a in fb.ARMS) + " |",
              "|---|" + "---|" * (len(fb.BUDGETS) * len(fb.ARMS))]
    for where, cost in COSTS.items():
        cells = [seconds_to_spend(a, b, **cost) for b in fb.BUDGETS for a in fb.ARMS]
        summary["seconds"][where] = dict(zip([f"{a}@{b}" for b in fb.BUDGETS for a in fb.ARMS], cells))
        lines.append(f"| {where} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    draw(summary, start, os.path.join(folder, "rewards.png"))
    return "\n".join(lines)


def draw(summary, start, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    cpu = summary["seconds"][CPU]
    for i, arm in enumerate(fb.ARMS):
        keys = [f"{arm}@{b}" for b in fb.BUDGETS if f"{arm}@{b}" in summary["confirm"]]
        if not keys:
            continue
        stats = [summary["confirm"][k] for k in keys]
        mean = [start] + [s[0] for s in stats]
        err = [[0] + [s[0] - s[1] for s in stats], [0] + [s[2] - s[0] for s in stats]]
        label = f"{arm} (" + ", ".join(f"{summary['chosen_lr'][k]:g}" for k in keys) + ")"
        for ax, xs in ((axes[0], [0] + [int(k.split("@")[1]) for k in keys]),
                       (axes[1], [0] + [cpu[k] * 5.91 for k in keys])):
            ax.errorbar([x + (i - 1.5) * (0.6 if ax is axes[0] else 2) for x in xs], mean, yerr=err,
                        marker="o", capsize=3, label=label, color=f"C{i}")
    axes[0].set(xlabel="completions generated", title="per completion (measured)")
    axes[1].set(xlabel="seconds on one EPYC core (the cost model's, from measured parts)",
                title="per second on one EPYC core (cost model)")
    for ax in axes:
        ax.set_ylabel("held-out reward, −|40 − characters|")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="arm (rate at each budget)", title_fontsize=8)
    fig.suptitle(textwrap.fill("Confirmation seeds only: mean and 95 % t-interval over the seeds (points "
                               "nudged sideways to be seen). " + SETTING, 180), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(fb.FOLDER, "rows.jsonl")
    print(report(fb.read(path), os.path.dirname(path)))
