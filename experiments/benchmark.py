"""
What one optimizer step costs on the machine at hand, phase by phase, and where μ > 1 or S > 1 would pay per
second.

Each configuration is a run of train_tldr.py's training (the cpu preset unless --preset says otherwise) in a
process of its own, so that its peak RSS is its own, on the shape of the TRL 1.16 reference below (4 prompts
× 8 completions of 64 tokens per optimizer step; train_tldr.py flags override it), logging every step.
Decoding has a fixed length: no EOS ends a completion, every one is max_completion_length tokens, so that
what the model learns cannot move the clock. The configurations: μ = 1 and μ = 4 at β = 0 and 0.04, and
μ = 1 with S = 4 (steps_per_generation = 4 × gradient_accumulation_steps: a generation batch 4 times larger
serves 4 optimizer steps, each on completions of its own); with --bf16, each also under bf16 autocast.

The table: the median seconds of each phase per optimizer step, a generation step apart from the steps
between generations, and their mean over a cycle. Then the cost model, from the machine's numbers alone
(fp32, β = 0): g, the generation share of a μ = 1 step; l, one π_old log-prob pass over one step's
completions relative to a μ = 1 step; r_S, how many times longer the generation of an S times larger batch
takes; then T(μ, S)/T(1, 1) = (1 − g) + (g·r_S + [μS > 1]·S·l)/(μ·S) (r_1 = 1), predicted beside
measured, and the worth a step must have, in fresh steps, for each arm to pay per second:
w*(μ) = 1 − g + l/(μ − 1) for a reuse step, w*_S = (S(1 − g) + g·r_S + S·l − 1)/(S − 1) for a step on a
stale mini-batch. Beside this machine's g, the generation share g* above which each arm paid per second on
2-digit sums (experiments/addition_results/summary.json, with its interval): the rule "μ = k pays if g > g*"
as a command.

    python -m experiments.benchmark [--bf16] [--benchmark-steps N] [train_tldr.py flags]
"""
import json, math, os, shutil, statistics, subprocess, sys

import torch

import grpo_long_runs as gm
import train_tldr
from experiments.addition_report import pays_at, share

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCHMARK = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, max_prompt_length=64,
                 max_completion_length=64, log_completions=False)
S = 4  # the S arm: steps_per_generation = S × gradient_accumulation_steps
CONFIGURATIONS = [(1, 1, 0.0), (1, 1, 0.04), (4, 1, 0.0), (4, 1, 0.04), (1, S, 0.0)]  # (μ, S, β)
REFERENCE = ("TRL 1.16, float32, at this benchmark's default shape, side by side on 2 cores of an AMD EPYC "
             "on 2026-11-30 (docs/performance.md#against-trl-116, experiments/trl_reference.py): 76.8 s/step "
             "and 5.53 GiB peak RSS at μ=1, β=0, where grpo_multistep took 44.7 s and 4.01 GiB. Compare only "
             "figures of one machine's side-by-side run.")
SUMMARY = os.path.join(ROOT, "experiments", "addition_results", "summary.json")  # the addition study's report


def parse_args(argv):  # the benchmark's shape first: any flag given after it wins
    parser = train_tldr.make_parser(__doc__)
    parser.add_argument("--benchmark-steps", type=int, default=4, help="optimizer steps per configuration "
                        "(rounded up to whole generation cycles of μ·S steps)")
    parser.add_argument("--child", action="store_true", help="(one configuration, in the process of its own)")
    checks = lambda opts: [("--benchmark-steps", opts.benchmark_steps >= 1, "must be >= 1")]
    return train_tldr.parse_args([*as_flags(BENCHMARK), *argv], parser, preset="cpu", checks=checks)


def as_flags(values):
    return [f"--{k}={v}" for k, v in values.items()]


def markdown_table(rows):  # rows: dicts with the same keys; floats to 3 significant digits
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    return "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
                      + ["| " + " | ".join(c) + " |" for c in cells])


class FixedLength(train_tldr.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.eos_token_ids = torch.tensor([], dtype=torch.long)  # nothing ends a completion early


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config, opts = parse_args(argv)
    opts.script, opts.argv = "-mexperiments.benchmark", argv  # python -mexperiments.benchmark: -m, no space
    if opts.child:
        return train_tldr.run_all(config, [config], config.output_dir, opts, FixedLength, lambda *args: None)
    try:
        return benchmark(config, opts, argv)
    except KeyboardInterrupt:
        print("\ninterrupted by Ctrl-C")
        return 130


def benchmark(config, opts, argv):
    """Each configuration in a fresh process; the per-step phase times come from the core's metrics."""
    train_tldr.resolve_model(opts.model)  # converted here, once, before the processes look for it
    mus = ",".join(sorted({str(mu) for mu, _, _ in CONFIGURATIONS}))
    folder, rows = train_tldr.run_dir(config.output_dir, mus, several=True) + "-benchmark", []
    for dtype in ("fp32", "bf16") if config.bf16 else ("fp32",):
        for mu, s, beta in CONFIGURATIONS:
            name = f"μ={mu}" + (f" S={s}" if s > 1 else "") + f" β={beta:g} {dtype}"
            out = os.path.join(folder, name.replace(" ", "-"))
            flags = {"num_iterations": mu, "steps_per_generation": s * config.gradient_accumulation_steps,
                     "beta": beta, "bf16": dtype == "bf16", "logging_steps": 1, "output_dir": out,
                     "max_steps": math.ceil(opts.benchmark_steps / (mu * s)) * mu * s}
            print(f"\n=== benchmark {name}: {flags['max_steps']} optimizer steps in a fresh process ===",
                  flush=True)
            # Later flags win: the benchmark's shape, then the user's flags, then this configuration's.
            cmd = [sys.executable, "-m", "experiments.benchmark", "--child", *as_flags(BENCHMARK), *argv,
                   *as_flags(flags)]
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code == 130:
                raise KeyboardInterrupt
            if code:
                train_tldr.fail(f"benchmark configuration {name} failed (exit status {code}): its output is "
                                "above")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                records = [json.loads(line) for line in f]
            for entry in os.scandir(out):  # checkpoint and final model: GBs that the table does not need
                if entry.is_dir():
                    shutil.rmtree(entry.path)
                elif entry.name != "metrics.jsonl":
                    os.remove(entry.path)
            rows += phase_rows(name, records, mu, s)
            print(markdown_table(rows))
    shape = {k: getattr(config, k) for k in BENCHMARK}
    table, model = markdown_table(rows), cost_model(rows, config)
    with open(os.path.join(folder, "benchmark.md"), "w") as f:
        f.write(f"Median seconds per optimizer step, {opts.model}, {shape}, fixed-length decoding\n\n"
                f"{table}\n\n{model}\n\nReference: {REFERENCE}\n")
    print(f"\n{table}\n\n{model}\n\nReference: {REFERENCE}\nwritten: {folder}/benchmark.md")
    return 0


def phase_rows(name, records, mu, s=1):
    """Median seconds per optimizer step for each phase, 'other' being the step's wall time minus the phases.
    Where a generation serves μ·s > 1 steps, the generation step and the steps after it cost different things,
    so they get a row each, plus their mean: what one step costs over a whole cycle."""
    walls = [b["elapsed"] - a["elapsed"] for a, b in zip([{"elapsed": 0.0}] + records, records)]
    steps = []
    for r, wall in zip(records, walls):
        step = {p: r[f"time_{p}"] for p in gm.PHASES}
        steps.append({**step, "other": wall - sum(step.values()), "total": wall})
    cycle, later = mu * s, "reuse steps" if mu > 1 else "later mini-batch steps"
    between = [x for i, x in enumerate(steps) if i % cycle]  # the steps that did not generate
    groups = {name: steps} if cycle == 1 else {f"{name} generation step": steps[::cycle],
                                                f"{name} {later}": between}
    peaks = {"peak RSS GiB": max(r["peak_rss_gib"] for r in records)}
    if "peak_cuda_gib" in records[-1]:
        peaks["peak CUDA GiB"] = max(r["peak_cuda_gib"] for r in records)
    rows = []
    for label, group in groups.items():
        medians = {k: statistics.median(x[k] for x in group) for k in group[0]}
        rows.append({"configuration": label, "steps": len(group), **medians,
                     "other %": 100 * medians["other"] / medians["total"], **peaks})
    if cycle > 1:
        mean = {k: (rows[0][k] + (cycle - 1) * rows[1][k]) / cycle for k in (*gm.PHASES, "other", "total")}
        rows.append({"configuration": f"{name} per step over a cycle", "steps": len(steps), **mean,
                     "other %": 100 * mean["other"] / mean["total"], **peaks})
    return rows


def cost_model(rows, config):
    """g, l, the decode speed and r_S from the fp32 rows at β = 0; then, per arm, T(μ, S)/T(1, 1) predicted
    and measured and the break-even worth w*; and this machine's g against the addition study's g*."""
    row = {r["configuration"]: r for r in rows}
    one, four, big = (row.get(n) for n in ("μ=1 β=0 fp32", "μ=4 β=0 fp32 generation step",
                                           f"μ=1 S={S} β=0 fp32 generation step"))
    if not (one and four and big):
        return f"g, l, r_S and the rule need the μ = 1, μ = 4 and S = {S} configurations at β = 0 in fp32"
    g, l, r = one["generate"] / one["total"], four["logps"] / one["total"], big["generate"] / one["generate"]
    tokens = config.max_completion_length
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps  # one step's completions
    lines = [f"Cost model, from the fp32 rows at β = 0 (every completion {tokens} tokens):",
             f"- g = {g:.3f}: the generation share of a μ = 1 step (T(1, 1) = {one['total']:.3g} s)",
             f"- l = {l:.3f}: one π_old log-prob pass over one step's completions, relative to a μ = 1 step "
             "(μ = 4's generation step)",
             f"- decode: {1000 * one['generate'] / tokens:.3g} ms per token for one generation batch "
             f"({batch} completions), {1000 * big['generate'] / tokens:.3g} ms for one {S}× larger "
             f"({S * batch}: S = {S}'s generation step); r_{S} = {r:.3f}, its generation time ÷ one batch's",
             "- T(μ, S)/T(1, 1) = (1 − g) + (g·r_S + [μS > 1]·S·l)/(μ·S), r_1 = 1",
             "- μ pays per second where a reuse step is worth more than w*(μ) = 1 − g + l/(μ − 1) of a fresh "
             "step; S pays where a stale mini-batch is worth more than",
             "  w*_S = (S(1 − g) + g·r_S + S·l − 1)/(S − 1) of a fresh one"]
    arms = []
    for arm, mu, s, cycle_row in (("μ=2", 2, 1, None), ("μ=4", 4, 1, "μ=4 β=0 fp32 per step over a cycle"),
                                  (f"S={S}", 1, S, f"μ=1 S={S} β=0 fp32 per step over a cycle")):
        r_s = r if s > 1 else 1.0
        predicted = (1 - g) + (g * r_s + (mu * s > 1) * s * l) / (mu * s)
        w_star = 1 - g + l / (mu - 1) if s == 1 else (s * (1 - g) + g * r_s + s * l - 1) / (s - 1)
        measured = row[cycle_row]["total"] / one["total"] if cycle_row in row else None
        arms.append({"arm": arm, "T(μ, S)/T(1, 1) predicted": f"{predicted:.3f}", "measured": "—"
                     if measured is None else f"{measured:.3f}", "break-even worth w*": f"{w_star:.3f}"})
    lines += ["", markdown_table(arms), "", break_even_rule(g)]
    return "\n".join(lines)


def break_even_rule(g):
    """This machine's g beside each arm's g* from the addition study's summary: where the arm would pay here,
    if a completion is worth here what it was worth on 2-digit sums."""
    if not os.path.exists(SUMMARY):
        return f"{os.path.relpath(SUMMARY)} does not exist: no g* to set beside g = {g:.3f}."
    with open(SUMMARY) as f:
        found = json.load(f)["break_even"]["rows"]
    arms = []
    for entry in found:
        g_star = entry["g_star"]
        arms.append({"arm": entry["arm"], "r": f"{entry['r']:g}", "completions": f"{entry['completions']:,}",
                     "g* [interval]": f"{share(g_star['mean'])} [{share(g_star['low'])}, "
                                      f"{share(g_star['high'])}]",
                     f"here, g = {g:.3f}": pays_at(g, g_star)})
    return (f"On 2-digit sums ({os.path.relpath(SUMMARY)}: a 332k-weight model, 6-token completions, one CPU "
            "core), each arm at its tuned rate would pay per second against μ = 1 on a machine whose g "
            "exceeds g*, by the cost model (r: a 4× larger generation call's time per completion against one "
            "call's, S = 4's only). Here: pays where g lies above g*'s interval, does not where below, "
            "undecided inside, if a completion is worth here what it was worth there.\n\n"
            + markdown_table(arms))


if __name__ == "__main__":
    sys.exit(main())
