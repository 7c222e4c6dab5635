"""
The table, the chart and summary.json of experiments/update_clock.py's rows (docs/update-clock/).

Per arm and learning rate: the held-out reward at each scored step, mean over seeds with a bootstrap 95 %
interval; each arm's best rate (by its held-out reward at the last step) and whether the grid brackets it;
at each arm's best rate, its difference from μ = 1 at μ = 1's best rate, by optimizer steps and by
completions generated, with paired bootstrap intervals (the seeds are shared: seed s draws the same first
prompts and samples in every arm); the worth w of an off-policy step (a reuse step for μ > 1, a stale
mini-batch for S > 1) in fresh steps, with its interval; the off-policy steps' clip fraction.

A paired difference whose t-interval holds 0 reads "inconclusive".

    python -m experiments.report_update_clock [runs/update-clock/rows.jsonl]
    python -m experiments.report_update_clock docs/update-clock/rows.jsonl   # the committed study's table
"""
import json, os, sys
from collections import defaultdict

import numpy as np

# Few seeds: a t-interval beside the bootstrap.
from experiments.report_fixed_budget import reading, t_interval
from experiments.update_clock import ROWS

BOOTSTRAP, CI = 10_000, (2.5, 97.5)
SETTING = ("SmolLM2-135M-Instruct, the length reward −|40 − len(completion)| on 40 TL;DR-style "
           "posts, held-out reward on 8 others; 8 completions (1 prompt) per optimizer step, 16 steps")


def read(path):
    if not os.path.isfile(path):
        raise SystemExit(f"error: no rows file {path!r}: run python -m experiments.update_clock first")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    if not any(r["step"] == 0 for r in rows) or not last_attempts(rows):
        raise SystemExit(f"error: {path!r} holds no finished run (and the untrained score) yet")
    return rows


def last_attempts(rows):
    """Each run's rows from its last start (a run cut short is run again from step 1), if it ended."""
    runs = {}
    for r in rows:
        if r["arm"] is not None:
            key = r["arm"], r["lr"], r["seed"]
            runs[key] = [r] if r["step"] == 1 else runs.get(key, []) + [r]
    return {key: run for key, run in runs.items() if run[-1].get("end")}


def curves(rows):
    """{(arm, lr): {seed: {step: held-out reward}}} of the runs that ended, each starting at step 0."""
    start = next(r["eval_reward"] for r in rows if r["step"] == 0)
    out = defaultdict(lambda: defaultdict(lambda: {0: start}))
    for (arm, lr, seed), run in last_attempts(rows).items():
        out[arm, lr][seed].update({r["step"]: r["eval_reward"] for r in run if "eval_reward" in r})
    return out


def cycle(arm):  # optimizer steps per generation batch, and how many of them are its mini-batches
    mu, S = (int(arm[2:]), 1) if arm.startswith("μ") else (1, int(arm[2:]))
    return mu * S, S


def reward_at(curve, x):
    """A curve's value at x (steps or completions), linear between its points."""
    xs = sorted(curve)
    return float(np.interp(x, xs, [curve[k] for k in xs]))


def first_crossing(curve, y):
    """The first x where the curve (linear between its points) reaches y: None if it never does."""
    xs = sorted(curve)
    if curve[xs[0]] >= y:
        return float(xs[0])
    for a, b in zip(xs, xs[1:]):
        if curve[a] < y <= curve[b]:
            return a + (b - a) * (y - curve[a]) / (curve[b] - curve[a])
    return None


def worth(baseline, reward, n, fresh):
    """What an off-policy step is worth in fresh steps: the arm's n steps, `fresh` of them on-policy, reach
    `reward`, which the baseline (μ = 1, every step fresh) reaches after n_eq steps; w = (n_eq − fresh) /
    (n − fresh); < 0: worse than its fresh steps alone. Censored where the baseline never gets there."""
    n_eq = first_crossing(baseline, reward)
    return np.inf if n_eq is None else (n_eq - fresh) / (n - fresh)  # inf: the baseline never got there


def mean_curve(seeds, chosen=None):
    chosen = sorted(seeds) if chosen is None else chosen
    steps = sorted(set.intersection(*(set(seeds[s]) for s in chosen)))
    return {k: float(np.mean([seeds[s][k] for s in chosen])) for k in steps}


def bootstrap(seeds_by_arm, statistic, rng):
    """The statistic on the seeds, and its 95 % interval from resampling the seeds, paired across arms."""
    shared = sorted(set.intersection(*(set(s) for s in seeds_by_arm.values())))
    value = statistic({a: mean_curve(s, shared) for a, s in seeds_by_arm.items()})
    draws = [statistic({a: mean_curve(s, list(pick)) for a, s in seeds_by_arm.items()})
             for pick in rng.choice(shared, (BOOTSTRAP, len(shared)))]
    low, high = np.percentile(draws, CI, method="nearest")  # nearest: a censored draw (inf) stays one
    return value, float(low), float(high), len(shared)


def best_rates(data):
    """Each arm's best learning rate by mean held-out reward at its last step, and whether its grid
    brackets it (a rate on both sides). Rates with fewer seeds than the grid's (a pilot) do not compete."""
    best, full = {}, max(map(len, data.values()))
    for arm in sorted({a for a, _ in data}):
        lrs = sorted(lr for a, lr in data if a == arm and len(data[a, lr]) == full)
        final = {lr: mean_curve(data[arm, lr])[max(mean_curve(data[arm, lr]))] for lr in lrs}
        lr = max(final, key=final.get)
        best[arm] = {"lr": lr, "inside": lrs[0] < lr < lrs[-1], "final": final}
    return best


def fmt(v, lo, hi, digits=1):
    show = lambda x: "> 1" if x == np.inf else f"{x:.{digits}f}"
    return f"{show(v)} [{show(lo)}, {show(hi)}]"


def report(rows, folder):
    rng = np.random.default_rng(0)
    data, clips = curves(rows), defaultdict(list)
    for (arm, lr, _), run in last_attempts(rows).items():
        clips[arm, lr] += [r["clip"] for r in run if (r["step"] - 1) % cycle(arm)[0]]  # not a batch's first
    best, lines = best_rates(data), [f"Setting: {SETTING}.", ""]
    steps = sorted(mean_curve(data[next(iter(data))]))
    lines += ["Held-out reward by optimizer step, mean over seeds [bootstrap 95 % interval]; off-policy "
              "steps' clip fraction (reuse steps, stale mini-batches).", "",
              "| arm | lr | seeds | " + " | ".join(f"step {k}" for k in steps) + " | clip |",
              "|---|---|---|" + "---|" * (len(steps) + 1)]
    for arm, lr in sorted(data):
        seeds = data[arm, lr]
        cells = [fmt(*bootstrap({arm: seeds}, lambda m, k=k: m[arm][k], rng)[:3]) for k in steps]
        clip = f"{np.mean(clips[arm, lr]):.3f}" if clips[arm, lr] else "—"
        mark = " **best**" if best[arm]["lr"] == lr else "" if lr in best[arm]["final"] else " (pilot)"
        lines.append(f"| {arm} | {lr:g}{mark} | {len(seeds)} | " + " | ".join(cells) + f" | {clip} |")
    base, n = ("μ=1", best["μ=1"]["lr"]), steps[-1]
    lines += ["", f"Each arm at its best rate against μ = 1 at its best ({base[1]:g}), paired by seed: the "
              f"difference in held-out reward at step {n} and at equal completions generated; w: what an "
              "off-policy step is worth in fresh steps (1: as much; 0: nothing; > 1: the baseline never got "
              "there).", "",
              "| arm | best lr | inside the grid | Δ by steps | Δ by steps, paired t-interval | "
              "reading | Δ by completions (μ = 1 at step) | w |", "|---|---|---|---|---|---|---|---|"]
    summary = {"setting": SETTING, "w": {}, "best_lr": {}, "delta_steps": {}, "delta_completions": {}}
    for arm in sorted(best):
        lr, (n_cycle, S) = best[arm]["lr"], cycle(arm)
        pair = {"base": data[base], "arm": data[arm, lr]}
        at = n * S / n_cycle  # μ = 1 steps that generate as many completions as the arm's n steps
        d_steps = bootstrap(pair, lambda m: m["arm"][n] - m["base"][n], rng)
        shared = sorted(set(pair["base"]) & set(pair["arm"]))
        diffs = [pair["arm"][s][n] - pair["base"][s][n] for s in shared]
        d_t = t_interval(diffs)[:3] if arm != "μ=1" else None
        d_compl = bootstrap(pair, lambda m: m["arm"][n] - reward_at(m["base"], at), rng)
        fresh = n / n_cycle  # each generation batch's first step is on-policy (ratio 1)
        w = bootstrap(pair, lambda m: worth(m["base"], m["arm"][n], n, fresh), rng) if arm != "μ=1" else None
        lines.append(f"| {arm} | {lr:g} | {'yes' if best[arm]['inside'] else 'no: extend the grid'} | "
                     f"{fmt(*d_steps[:3])} | {fmt(*d_t) if d_t else '—'} | {reading(d_t) if d_t else '—'} | "
                     f"{fmt(*d_compl[:3])} ({at:g}) | "
                     f"{fmt(*w[:3], 2) if w else '—'} |")
        summary["best_lr"][arm], summary["delta_steps"][arm] = lr, d_steps[:3]
        summary.setdefault("delta_steps_t", {})[arm] = d_t
        summary["delta_completions"][arm] = d_compl[:3]
        if w:
            summary["w"][arm] = [None if not np.isfinite(x) else x for x in w[:3]]
    with open(os.path.join(folder, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    draw(data, best, base, os.path.join(folder, "rewards.png"), rng)
    return "\n".join(lines)


def draw(data, best, base, path, rng):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for arm in sorted(best):
        seeds, (n_cycle, S) = data[arm, best[arm]["lr"]], cycle(arm)
        steps = sorted(mean_curve(seeds))
        stats = [bootstrap({arm: seeds}, lambda m, k=k: m[arm][k], rng) for k in steps]
        mean, low, high = (np.array([s[i] for s in stats]) for i in range(3))
        label = f"{arm} (lr {best[arm]['lr']:g})"
        for ax, xs in ((axes[0], np.array(steps)), (axes[1], np.ceil(np.array(steps) / n_cycle) * 8 * S)):
            line, = ax.plot(xs, mean, marker="o", label=label)
            ax.fill_between(xs, low, high, color=line.get_color(), alpha=0.15)
        lrs = sorted(best[arm]["final"])
        axes[2].plot(lrs, [best[arm]["final"][lr] for lr in lrs], marker="o", label=arm)
    axes[0].set(xlabel="optimizer steps", title="by optimizer steps (each arm at its best rate)")
    axes[1].set(xlabel="completions generated", title="by completions generated")
    axes[2].set(xlabel="learning rate", xscale="log", title=f"at step {max(steps)}, by learning rate")
    for ax in axes:
        ax.set_ylabel("held-out reward: −|40 − characters|")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Mean over seeds; bands: bootstrap 95 % intervals of the mean. " + SETTING, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else ROWS
    print(report(read(path), os.path.dirname(path)))
