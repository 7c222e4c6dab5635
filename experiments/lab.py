"""
The lab beside train_tldr.py's demo: TRL PR #2899's experiment measured well enough to say when μ pays.

Every train_tldr.py flag works here, and these:
  --lrs LR...          every μ of --sweep at every learning rate: the μ × learning-rate grid
  --seeds N            each μ (and rate) with the seeds seed, seed+1, ..., seed+N-1, the same for every μ
  --time-budget S      stop each run after S seconds of training (every run gets the same seconds)
  --target-reward X    stop a run once the mean of its last 3 logged rewards reaches X
Into the sweep's folder go sweep.jsonl (every logged point of every run), rewards.md (a row per μ and learning
rate: the rewards by the same budget of completions and of seconds, the cost of a step measured and predicted,
what a reuse step was worth, mean ± sd over the seeds; its notes say how each is computed) and rewards.png
(one learning rate: the reward against optimizer steps, completions generated and seconds; several: the reward
by the seconds budget against the learning rate, then against seconds and completions at each μ's best rate;
mean and min-max band over the seeds). --resume finishes a sweep cut short.

    python -m experiments.lab --sweep 1 2 4 --lrs 1.25e-6 5e-6 2e-5 --seeds 3 --time-budget 180 \\
        --max_steps 1000 --lr_scheduler_type constant --log_completions False   # a μ × learning-rate grid
    python -m experiments.lab --sweep 1 4 --seeds 2 --time-budget 300
    python -m experiments.lab --target-reward -15

Its rewards are the training rewards of each generation batch (fresh samples of the policy on training
prompts), not a held-out score: experiments/heldout.py's serves the experiments that keep prompts apart.
"""
import dataclasses, json, math, os, statistics, sys

import numpy as np

import train_tldr  # (its import sets matplotlib's file-only backend)
import matplotlib.pyplot as plt  # noqa: E402
from experiments.metric_names import clip_fraction

RECENT = 3  # "the reward now" = mean of the last RECENT logged rewards (one is noisy)
CLOCKS = (*train_tldr.CLOCKS, ("elapsed", "wall-clock seconds"))
CLOCK_UNITS = {"generated_completions": "completions", "elapsed": "s"}


def parse_args(argv):
    parser = train_tldr.make_parser(__doc__)
    parser.add_argument("--lrs", type=float, nargs="+", metavar="LR", help="one run per learning rate too, "
                        "each μ and seed at each: the μ × learning-rate grid (constant schedule: "
                        "--lr_scheduler_type constant)")
    parser.add_argument("--seeds", type=int, default=1, metavar="N", help="runs per μ, with the seeds seed, "
                        "seed+1, ..., seed+N-1 (the same for every μ); charts: their mean, min-max band")
    parser.add_argument("--time-budget", type=float, help="stop each run after this many seconds of training")
    parser.add_argument("--target-reward", type=float,
                        help=f"stop once the mean of the last {RECENT} logged rewards reaches this")
    return train_tldr.parse_args(argv, parser, checks=lambda opts: [
        ("--lrs", not opts.lrs or min(opts.lrs) > 0, "values must be > 0"),
        ("--lrs", not opts.lrs or len(set(opts.lrs)) == len(opts.lrs), "values must differ"),
        ("--seeds", opts.seeds >= 1, "must be >= 1"),
        ("--time-budget", opts.time_budget is None or opts.time_budget > 0, "must be > 0"),
        ("--resume", opts.resume in (None, True) or (opts.seeds == 1 and len(opts.lrs or [0]) == 1),
         "CHECKPOINT names one run's checkpoint; a sweep resumes with --resume alone")])


class Trainer(train_tldr.Trainer):
    opts = None  # the lab's flags (main sets them): the budgets that stop a run

    def log(self, metrics):
        """The demo's log, then the lab's stops: the target reward reached, the time budget spent."""
        super().log(metrics)
        target, budget = self.opts.target_reward, self.opts.time_budget
        reached = target is not None and first_reaching(train_tldr.run_points(self.args), target)
        spent = budget is not None and metrics["elapsed"] >= budget
        if reached and self.rank == 0:
            print(f"target reward {target:g} reached at step {reached['step']}, {reached['elapsed']:.3g} s")
        elif spent and self.rank == 0:
            print(f"time budget of {budget:g} s spent at step {metrics['step']}")
        self.should_stop |= bool(reached or spent)  # every rank stops where any asks (the core all-reduces)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config, opts = parse_args(argv)
    opts.script, opts.argv, Trainer.opts = "-mexperiments.lab", argv, opts  # python -mexperiments.lab: -m
    mus, lrs = opts.sweep or [config.num_iterations], opts.lrs or [config.learning_rate]
    seeds = [config.seed + i for i in range(opts.seeds)]
    several = len(mus) * len(lrs) * len(seeds) > 1
    label = (",".join(map(str, mus)) + (f"-lrs={','.join(f'{lr:g}' for lr in lrs)}" if len(lrs) > 1 else "")
             + (f"-seeds={seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else ""))
    folder = lambda label: train_tldr.run_dir(config.output_dir, label, several)
    name = lambda mu, lr, seed: (f"{mu}" + (f"-lr={lr:g}" if len(lrs) > 1 else "")  # a run's folder
                                 + (f"-seed={seed}" if len(seeds) > 1 else ""))
    # Seed by seed, each through every learning rate and μ: a machine whose speed drifts during the sweep
    # slows every μ alike.
    configs = [dataclasses.replace(config, num_iterations=mu, seed=seed, learning_rate=lr,
                                   output_dir=folder(name(mu, lr, seed)))
               for seed in seeds for lr in lrs for mu in mus]
    return train_tldr.run_all(config, configs, folder(label), opts, Trainer, report)


# ---- The points: train_tldr's, with each one's seconds per step and the reward carried over reuse steps ----
def run_points(config):
    """train_tldr.run_points, each point with step_seconds (elapsed since the point before, per optimizer step
    since then) and, on the steps that generated nothing, the reward of the newest generation batch."""
    points, before = [], {"step": 0, "elapsed": 0.0}
    for p in train_tldr.run_points(config):
        before = {"reward": before.get("reward"), **p,
                  "step_seconds": (p["elapsed"] - before["elapsed"]) / (p["step"] - before["step"])}
        points.append(before)
    return points


def logged_runs(configs):  # the runs that logged a reward: each its μ, learning rate, seed and points
    runs = [{"mu": c.num_iterations, "lr": c.learning_rate, "seed": c.seed, "points": run_points(c)}
            for c in configs]
    return [r for r in runs if generated(r["points"])]


def generated(points):  # the points whose steps generated: their reward was measured on a fresh batch
    return [p for p in points if p["generated"]]


# ---- The statistics --------------------------------------------------------------------------------------
def recent_reward(points):
    rewards = [p["reward"] for p in generated(points)][-RECENT:]
    return sum(rewards) / len(rewards) if rewards else None


def first_reaching(points, target):
    """The first generation point at which the mean of the last RECENT generation rewards is >= target."""
    fresh = generated(points)
    for i in range(RECENT, len(fresh) + 1):
        if recent_reward(fresh[:i]) >= target:
            return fresh[i - 1]
    return None


def reward_by(run, clock, x):
    """A run's reward by x on a clock ("generated_completions", "elapsed"): the mean reward of its
    generation batches in the last third of [0, x], or of its newest one before, if none is in it. One
    batch of a few completions is noisy; the last third averages the latest policies at the same lag on
    every μ (more batches where μ = 1 generates more often)."""
    fresh = [p for p in generated(run["points"]) if p[clock] <= x] or generated(run["points"])[:1]
    window = [p["reward"] for p in fresh if p[clock] > 2 * x / 3] or [fresh[-1]["reward"]]
    return statistics.mean(window)


def phase_seconds(points, *phases):
    """A run's seconds in these phases: each point's time_* averages the steps since the previous point."""
    steps = [b["step"] - a["step"] for a, b in zip([{"step": 0}] + points, points)]
    return sum(p[f"time_{x}"] * n for p, n in zip(points, steps) for x in phases)


def seconds_per_step(run):
    return run["points"][-1]["elapsed"] / run["points"][-1]["step"]


def cost_shares(runs):
    """(g, l) of the μ = 1 runs: the share of their seconds spent on what μ > 1 does once per generation
    batch (generating; with β > 0 also the reference pass, time_logps, which at μ = 1 is all it holds),
    and the share of their training forward, the nearest measurement of the π_old pass that μ > 1 adds."""
    total = sum(r["points"][-1]["elapsed"] for r in runs)
    return (sum(phase_seconds(r["points"], "generate", "logps") for r in runs) / total,
            sum(phase_seconds(r["points"], "forward") for r in runs) / total)


def reward_after(cell, s):
    """The reward of a cell's runs (one per seed) after s optimizer steps: each run's generation batches
    joined by straight lines, read at s, mean over the runs."""
    curves = [zip(*[(p["step"], p["reward"]) for p in generated(r["points"])]) for r in cell]
    return statistics.mean(float(np.interp(s, *curve)) for curve in curves)


def steps_to_reach(cell, reward, last):
    """The (fractional) optimizer steps after which reward_after first reaches `reward`, or None by `last`."""
    for s in range(2, last + 1):
        now, before = reward_after(cell, s), reward_after(cell, s - 1)
        if now >= reward:
            return s - (now - reward) / (now - before) if now > before else s
    return None


def where_mu_pays(runs, base, shares, seconds):
    """(w, g*): what a reuse step was worth in fresh steps, and the generation share g above which μ would
    win per second. Both from the updates to half of μ = 1's gain by the seconds budget (while the reward
    still rises, before any plateau): μ = 1 takes S1 (reward_after), μ takes s*, s*/μ of them on fresh
    batches, so S1 = s*/μ + w (s* - s*/μ). A μ step costs (1 - g) + (g + l)/μ of a μ = 1 step, so μ gets
    there first where s* ((1 - g) + (g + l)/μ) < S1: g > g* = (1 + l/μ - S1/s*) / (1 - 1/μ). Strings "< w",
    "> g*" where μ never got there (bounds from its last step); None where μ = 1's gain is within 2
    standard errors of 0: nothing to measure against."""
    mu, l, n = runs[0]["mu"], shares[1], len(base)
    gains = [reward_by(r, "elapsed", seconds) - generated(r["points"])[0]["reward"] for r in base]
    if n < 2 or statistics.mean(gains) <= 2 * statistics.stdev(gains) / math.sqrt(n):
        return None
    half = statistics.mean(generated(r["points"])[0]["reward"] + gain / 2 for r, gain in zip(base, gains))
    last, last_1 = (min(r["points"][-1]["step"] for r in cell) for cell in (runs, base))
    s1, s_mu = steps_to_reach(base, half, last_1), steps_to_reach(runs, half, last)
    if s1 is None:
        return None
    u1, u_mu = s1 - 1, (s_mu or last) - 1  # the updates behind the batch of step s: s - 1
    w, g_star = (u1 - u_mu / mu) / (u_mu * (1 - 1 / mu)), (1 + l / mu - u1 / u_mu) / (1 - 1 / mu)
    return (w, g_star) if s_mu else (f"< {w:.2f}", f"> {g_star:.2f}")


def mean_band(series):
    """series: one (xs, ys) per seed. The mean, min and max over the seeds on a common grid: the union of
    their xs where every seed has data (so that no seed joining late or ending early makes the mean jump),
    each seed interpolated onto it with np.interp. Ranges that do not overlap at all: each x averages the
    seeds that cover it."""
    grid = np.unique(np.concatenate([xs for xs, _ in series]))
    start, end = max(xs[0] for xs, _ in series), min(xs[-1] for xs, _ in series)
    if start <= end:
        grid = grid[(grid >= start) & (grid <= end)]
    values = np.full((len(series), len(grid)), np.nan)
    for i, (xs, ys) in enumerate(series):
        inside = (grid >= xs[0]) & (grid <= xs[-1])
        values[i, inside] = np.interp(grid[inside], xs, ys)
    return grid, np.nanmean(values, 0), np.nanmin(values, 0), np.nanmax(values, 0)


# ---- The report: rewards.md, rewards.png, sweep.jsonl ------------------------------------------------------
def spread(values):  # "12", or "9-12" when the seeds differ (one stopped early)
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def mean_sd(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def markdown_table(rows):  # rows: dicts with the same keys; floats to 3 significant digits
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                     + ["| " + " | ".join(c) + " |" for c in cells])


def sweep_row(mu, lr, runs, base, budget, target):
    """One row of the sweep table: the runs of one (μ, learning rate), one per seed. base: the μ = 1 runs at
    the same learning rate, or None; budget: the clocks' common ends, where every run is compared."""
    steps, recent = [r["points"][-1]["step"] for r in runs], [recent_reward(r["points"]) for r in runs]
    per_step = statistics.mean(map(seconds_per_step, runs))
    reuse = [p for r in runs for p in r["points"] if not p["generated"]]
    clips = [clip_fraction(p) for p in reuse]
    shares = cost_shares(base) if base else None
    worth = where_mu_pays(runs, base, shares, budget["elapsed"]) if base and mu > 1 else None
    row = {"μ": mu, "learning rate": lr,
           "g, l": "—" if mu > 1 or not shares else f"{shares[0]:.2f}, {shares[1]:.2f}",
           "seeds": len(runs), "steps": spread(steps),
           "generation batches": spread([math.ceil(s / mu) for s in steps]),
           f"final reward (mean of last {RECENT} logged)": mean_sd(recent)}
    for clock, x in budget.items():
        row[f"reward by {x:.4g} {CLOCK_UNITS[clock]}"] = mean_sd([reward_by(r, clock, x) for r in runs])
    if target is not None:
        reached = [x["elapsed"] for x in (first_reaching(r["points"], target) for r in runs) if x]
        row["time to target (median s)"] = (
            f"{statistics.median(reached):.3g} s, {len(reached)}/{len(runs)} seeds" if reached
            else f"not reached, 0/{len(runs)} seeds")
    predicted = "—" if shares is None else 1.0 if mu == 1 else (1 - shares[0]) + sum(shares) / mu
    return {**row, "s/step": per_step, "clip fraction, reuse steps": statistics.mean(clips) if clips else "—",
            "T(μ)/T(1) measured": per_step / statistics.mean(map(seconds_per_step, base)) if base else "—",
            "T(μ)/T(1) predicted": predicted,
            "reuse step worth w": "—" if worth is None else worth[0],
            "μ wins per second where g >": "—" if worth is None else worth[1]}


def table_note(budget, target):
    notes = [f"final reward: the mean of a run's last {RECENT} logged rewards (the reward now, as "
             "--target-reward reads it); mean ± sd: the mean over seeds, ± their standard deviation.",
             f"reward by {budget['generated_completions']:g} completions and by {budget['elapsed']:.4g} s "
             "(the most that every run reached): the mean reward of a run's generation batches in the last "
             "third of that budget, mean ± sd over seeds: the same budget of samples and of time for every "
             "μ."]
    if target is not None:
        notes.append("time to target: the median over the seeds that reached it, and how many did.")
    notes += ["s/step: a run's elapsed seconds ÷ its optimizer steps (the first step's warm-up included), "
              "mean over seeds; T(μ)/T(1) measured: μ's s/step ÷ μ = 1's at the same learning rate.",
              "clip fraction: the clip ratios at the low and the high bound, summed, on the logged steps "
              "that did not generate (reuse steps), mean over them and the seeds; μ = 1 never clips (its "
              "π_old is π_θ itself).",
              "T(μ)/T(1) predicted: (1 − g) + (g + l)/μ, from the μ = 1 runs at the same learning rate (g, l "
              "column): g, the share of their seconds spent generating (time_generate, plus time_logps: with "
              "β > 0 the reference pass, which μ > 1 also makes once per generation batch), and l, the share "
              "of a π_old log-prob pass, for which their training forward (time_forward) stands in (it keeps "
              "activations for the backward, so l may overstate a π_old pass, which runs without gradients).",
              "reuse step worth w and g*: μ = 1 takes S1 updates and μ takes s* to reach half of μ = 1's "
              "gain by the seconds budget (each run's batches joined by lines, mean over the seeds); s*/μ of "
              "μ's steps are on fresh batches: S1 = s*/μ + w (s* − s*/μ) (w = 1: a reuse step is worth a "
              "fresh one). μ's steps cost (1 − g) + (g + l)/μ of μ = 1's, so μ wins per second where g > "
              "g* = (1 + l/μ − S1/s*)/(1 − 1/μ) (≥ 1: nowhere); < and >: μ never got there (bounds). —: μ = "
              "1's gain is within 2 standard errors of 0 (where_mu_pays in experiments/lab.py)."]
    return "\n".join(f"- {note}" for note in notes)


def draw_curves(ax, runs, key, color, label):
    """The reward of runs (one per seed) against a clock: their mean as a line, their min-max as a band.
    The points: the steps that generated (the reward is measured on a generation batch)."""
    series = [(np.array([p[key] for p in generated(r["points"])], float),
               np.array([p["reward"] for p in generated(r["points"])], float)) for r in runs]
    grid, mean, low, high = mean_band(series)
    ax.plot(grid, mean, color=color, marker="." if len(series) == 1 else None,
            label=label + (f" ({len(series)} seeds: mean, min-max)" if len(series) > 1 else ""))
    if len(series) > 1:
        ax.fill_between(grid, low, high, color=color, alpha=0.2, linewidth=0)


def draw(groups, budget, target):
    """One learning rate: the reward against optimizer steps, completions generated and seconds, one colour
    per μ. Several (the μ × learning-rate grid): the reward at the seconds budget against the learning rate,
    one line per μ (mean over seeds, min-max band), then the reward against seconds and against completions
    at each μ's best learning rate."""
    mus, lrs = sorted({mu for mu, _ in groups}), sorted({lr for _, lr in groups})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    clocks = CLOCKS if len(lrs) == 1 else [("lr", "learning rate"), *CLOCKS[:0:-1]]
    for i, mu in enumerate(mus):
        color, cells = f"C{i % 10}", sorted(lr for m, lr in groups if m == mu)
        at_budget = [[reward_by(r, "elapsed", budget["elapsed"]) for r in groups[mu, lr]] for lr in cells]
        best = cells[int(np.argmax([statistics.mean(v) for v in at_budget]))]
        label = f"μ={mu}" + (f", learning rate {best:g}" if len(lrs) > 1 else "")
        if len(lrs) > 1:
            axes[0].plot(cells, [statistics.mean(v) for v in at_budget], color=color, marker="o",
                         label=f"μ={mu}")
            axes[0].fill_between(cells, [min(v) for v in at_budget], [max(v) for v in at_budget], color=color,
                                 alpha=0.2, linewidth=0)
        for ax, (key, _) in zip(axes[len(lrs) > 1:], clocks[len(lrs) > 1:]):
            draw_curves(ax, groups[mu, best], key, color, label)
    for ax, (key, xlabel) in zip(axes, clocks):
        if target is not None:
            ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if len(lrs) > 1:
        axes[0].set_xscale("log")
        axes[0].set_xticks(lrs, [f"{lr:g}" for lr in lrs], minor=False)
        axes[0].minorticks_off()
        axes[0].set_ylabel(f"reward by {budget['elapsed']:.4g} s (its last third)")
    else:
        axes[0].set_ylabel("mean reward of a generation batch")
    return fig


def report(config, configs, folder, opts):
    """Print the table of the runs and write it into `folder` as rewards.md, with the charts (rewards.png) and
    every logged point (sweep.jsonl)."""
    runs, groups = logged_runs(configs), {}  # (μ, learning rate) -> its runs, one per seed
    for run in runs:
        groups.setdefault((run["mu"], run["lr"]), []).append(run)
    if not groups:
        return print("nothing was logged, so there is nothing to report")
    budget = {"generated_completions": min(generated(r["points"])[-1]["generated_completions"] for r in runs),
              "elapsed": min(r["points"][-1]["elapsed"] for r in runs)}  # the most that every run reached
    seeds = sorted({r["seed"] for r in runs})
    title = f"{opts.model} on {opts.dataset}, reward -|{opts.target_chars} - len(completion)|"
    title += f", seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else ""
    title += f", target reward {opts.target_reward:g}" if opts.target_reward is not None else ""
    table = markdown_table([sweep_row(mu, lr, groups[mu, lr], groups.get((1, lr)), budget, opts.target_reward)
                            for lr, mu in sorted((lr, mu) for mu, lr in groups)])
    text = f"{table}\n\n{table_note(budget, opts.target_reward)}"
    train_tldr.save(draw(groups, budget, opts.target_reward), folder, title)
    with open(os.path.join(folder, "sweep.jsonl"), "w") as f:
        f.writelines(json.dumps(p) + "\n" for run in runs for p in run["points"])
    with open(os.path.join(folder, "rewards.md"), "w") as f:
        f.write(f"{title}\n\nGRPOConfig, changed from its defaults: {train_tldr.config_changes(config)}\n\n"
                f"{text}\n")
    print(f"\n{text}\n\nwritten: {folder}/rewards.md and sweep.jsonl")


if __name__ == "__main__":
    sys.exit(main())
