"""
What μ buys at a fixed budget of generated completions, each setting at the learning rate best for that
budget: the question a user with B completions to spend asks. The plan, written before the confirmation
runs: docs/fixed-budget/plan.md.

Task, model and shapes as docs/update-clock: SmolLM2-135M-Instruct, the length reward −|40 − len|, one
prompt × 8 completions (≤ 32 tokens) per optimizer step, constant learning rate (so a run read at step k
is a k-step run), β = 0. Arms: μ = num_iterations ∈ {1, 2, 4}, and steps_per_generation = 4 ×
gradient_accumulation_steps (S = 4) at μ = 1. A budget of B completions buys B/8 steps at μ = 1 and at S = 4,
μ·B/8 at μ > 1; each run is scored on the held-out posts at the step where it has spent each budget.

    python -m experiments.fixed_budget tune --worker 0 &  # one per core (taskset -c 0 / 1, OMP_NUM_THREADS=1)
    python -m experiments.fixed_budget tune --worker 1 &
    python -m experiments.fixed_budget report             # table.md, summary.json, rewards.png

`tune` runs phase 1 (seeds 42-47, every arm on its grid) and then, once the plan (--plan) exists, phase 2
for each arm whose tuning is over: fresh seeds, each budget at its chosen rate. `confirm` runs phase 2 only.

Resumable and shared by the workers: a run whose last row says "end" is kept; a run that was cut short is
run again from its first step (its rows carry another attempt id); a worker claims a run before it starts
it, so two never run the same one. Rows, claims and the report go to --folder, runs/fixed-budget by default
(outside docs/, ignored by git); `report --folder docs/fixed-budget` redraws the committed study's table.
The held-out score is experiments/heldout.py's. The tuning phase extends an arm's grid, a factor 2 at a
time, wherever a budget's best rate is at its edge, until every best is strictly inside.
"""
import argparse, math, os, shutil, statistics, tempfile, time, uuid

import grpo_multistep as gm
import train_tldr
from experiments import addition
from experiments.addition import alive, append, locked, read
from experiments.heldout import held_out_score
from experiments.metric_names import clip_fraction, metric

ARMS = {"μ=1": dict(num_iterations=1), "μ=2": dict(num_iterations=2), "μ=4": dict(num_iterations=4),
        "S=4": dict(num_iterations=1, steps_per_generation=4)}
BUDGETS = (32, 64)  # completions generated; 128 would cost μ = 4 64 steps a run (see the plan)
GRID = (4e-5, 8e-5, 1.6e-4)  # every arm's first grid; extended by FACTOR where a best lies at an edge
FACTOR, MAX_RATES = 2.0, 8
SEEDS = {"tune": tuple(range(42, 48)), "confirm": tuple(range(100, 112))}
SHAPE = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8,
             max_prompt_length=128, max_completion_length=32, temperature=1.0, beta=0.0,
             lr_scheduler_type="constant", logging_steps=1, save_steps=10**6, overwrite_output_dir=True)
EVAL_SAMPLES, TARGET_CHARS = 4, 40
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "runs", "fixed-budget")  # rows, claims, report: the run's own, never committed
PLAN = os.path.join(ROOT, "docs", "fixed-budget", "plan.md")  # committed before any confirmation row


# ---- The budget clock ----------------------------------------------------------------------------------
def per_generation(arm):  # completions in one generation batch, and optimizer steps it serves
    config = gm.GRPOConfig(**SHAPE, **ARMS[arm], output_dir=tempfile.gettempdir())
    S = gm.mini_batches_per_generation(config)
    return config.per_device_train_batch_size * config.gradient_accumulation_steps * S, \
        config.num_iterations * S


def steps_for(arm, budget):
    """The optimizer steps after which an arm has generated `budget` completions and taken every step that
    they serve: (budget / completions per generation batch) × steps per generation batch."""
    size, steps = per_generation(arm)
    gm.require(budget % size == 0, f"a budget of {budget} completions is not a whole number of {arm}'s "
               f"generation batches of {size}")
    return budget // size * steps


def budget_scores(run_rows, arm):
    """{budget: held-out reward} of one run: its score at the step where it has spent each budget."""
    at = {r["step"]: r["eval_reward"] for r in run_rows if "eval_reward" in r}
    return {b: at[steps_for(arm, b)] for b in BUDGETS if steps_for(arm, b) in at}


# ---- The rows ------------------------------------------------------------------------------------------
def finished_runs(rows):
    """{(phase, arm, lr, seed): that run's rows} for runs whose attempt reached its end (the last such); the
    untrained model's row (arm None) is no run."""
    return addition.finished_runs([r for r in rows if r.get("arm") is not None])


def scores(rows, phase):
    """{(arm, budget): {lr: {seed: held-out reward}}} of the phase's finished runs."""
    out = {}
    for (p, arm, lr, seed), run in finished_runs(rows).items():
        if p != phase:
            continue
        for b, score in budget_scores(run, arm).items():
            out.setdefault((arm, b), {}).setdefault(lr, {})[seed] = score
    return out


# ---- Choosing the rates ----------------------------------------------------------------------------------
def choose_rates(tuning, seeds):
    """{(arm, budget): (best lr, strictly inside its grid)}: the best by the mean over the tuning seeds, among
    the rates that every seed has finished."""
    chosen = {}
    for key, by_lr in tuning.items():
        means = {lr: statistics.mean(s.values()) for lr, s in by_lr.items() if set(s) >= set(seeds)}
        if means:
            best = max(means, key=means.get)
            chosen[key] = best, min(means) < best < max(means)
    return chosen


def tuning_grid(arm, rows):
    """The arm's rates: GRID, and a factor 2 beyond an edge wherever a budget's best lies on it, once every
    rate so far has every tuning seed."""
    grid = set(GRID)
    tuning, seeds = scores(rows, "tune"), SEEDS["tune"]
    while len(grid) < MAX_RATES:
        complete = all(set(tuning.get((arm, b), {}).get(lr, {})) >= set(seeds)
                       for b in BUDGETS for lr in grid)
        if not complete:
            break
        added = set()
        for b in BUDGETS:
            means = {lr: statistics.mean(tuning[arm, b][lr].values()) for lr in grid}
            best = max(means, key=means.get)
            added |= {best / FACTOR} if best == min(grid) else {best * FACTOR} if best == max(grid) else set()
        if not added:
            break
        grid |= added
    return sorted(grid)


def final_rates(rows):
    """{(arm, budget): lr} for the arms whose tuning is over: every budget's best strictly inside its grid."""
    chosen = choose_rates(scores(rows, "tune"), SEEDS["tune"])
    final = [arm for arm in ARMS if all(chosen.get((arm, b), (0, False))[1] for b in BUDGETS)]
    return {(arm, b): chosen[arm, b][0] for arm in final for b in BUDGETS}


def tasks(phase, rows):
    """The phase's runs, (arm, lr, seed, max_steps), seed by seed: a phase cut short has every arm at fewer
    seeds, not some at none. Confirmation: each arm whose tuning is over at its chosen rates, each run as far
    as the largest budget that chose its rate."""
    if phase == "tune":
        grids = {arm: tuning_grid(arm, rows) for arm in ARMS}
        return [(arm, lr, seed, steps_for(arm, max(BUDGETS))) for seed in SEEDS[phase] for arm in ARMS
                for lr in grids[arm]]
    chosen, runs = final_rates(rows), {}
    for (arm, b), lr in chosen.items():
        runs[arm, lr] = max(runs.get((arm, lr), 0), steps_for(arm, b))
    return [(arm, lr, seed, steps) for seed in SEEDS[phase] for (arm, lr), steps in sorted(runs.items())]


# ---- One run: train, and at each budget's step score the held-out posts ------------------------------
class Run(gm.GRPOTrainer):
    def log(self, metrics):
        step, (size, cycle) = metrics["step"], per_generation(self.tags["arm"])
        row = {**self.tags, "step": step, "completions": math.ceil(step / cycle) * size,
               "first_use": (step - 1) % cycle < cycle // self.args.num_iterations,  # ratio 1 at its start
               "clip": clip_fraction(metrics), "train_reward": metrics.get("reward"),
               "completion_length": metric(metrics, "completions/mean_length")}
        budgets = [b for b in BUDGETS if steps_for(self.tags["arm"], b) == step]
        if budgets:
            row.update(budget=budgets[0], **held_out_score(self, self.held_out, EVAL_SAMPLES))
        row["end"] = step == self.args.max_steps
        append(self.rows, row)


def run_one(phase, arm, lr, seed, max_steps, model, train, held_out, rows):
    out = tempfile.mkdtemp(prefix="fixed-budget-")
    try:
        config = gm.GRPOConfig(**SHAPE, **ARMS[arm], learning_rate=lr, seed=seed, max_steps=max_steps,
                               output_dir=out)
        reward = train_tldr.length_reward(TARGET_CHARS)
        trainer = Run(model, reward, args=config, train_dataset=gm.Dataset.from_dict({"prompt": train}))
        trainer.tags = {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "attempt": uuid.uuid4().hex[:8]}
        trainer.rows, trainer.held_out = rows, held_out
        if not any(r["step"] == 0 for r in read(rows)):  # the untrained model: the same for every run
            append(rows, {"phase": None, "arm": None, "step": 0, "completions": 0,
                          **held_out_score(trainer, held_out, EVAL_SAMPLES)})
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def claim_next(phases, rows_path, claims_path):
    """(phase, task): the first task of the phases, in order, that no run has finished and no live worker
    has claimed, now claimed by this process; None when none is left; "wait" while another worker's runs
    may still add tasks (a grid extended, an arm's tuning over)."""
    with locked(claims_path + ".lock"):
        rows, claims = read(rows_path), read(claims_path)
        done = set(finished_runs(rows))
        busy = {(c["phase"], c["arm"], c["lr"], c["seed"]) for c in claims if alive(c["pid"])} - done
        for phase in phases:
            todo = [t for t in tasks(phase, rows) if (phase, *t[:3]) not in done | busy]
            if todo:
                arm, lr, seed, _ = todo[0]
                append(claims_path, {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "pid": os.getpid()})
                return phase, todo[0]
        return "wait" if busy else None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["tune", "confirm", "report"])
    p.add_argument("--worker", type=int, default=0, help="a name for this worker's log lines")
    p.add_argument("--folder", default=FOLDER)
    p.add_argument("--plan", default=PLAN, help="the plan, written before any confirmation run")
    p.add_argument("--model", default=train_tldr.OFFLINE_MODEL)
    opts = p.parse_args(argv)
    os.makedirs(opts.folder, exist_ok=True)
    rows_path, claims_path = (os.path.join(opts.folder, n) for n in ("rows.jsonl", "claims.jsonl"))
    if opts.phase == "report":
        from experiments import report_fixed_budget  # (it imports this module)
        return print(report_fixed_budget.report(read(rows_path), opts.folder))
    # "tune" goes on to the confirmation runs of each arm whose tuning is over, once the plan is written
    plan = os.path.exists(opts.plan)
    phases = ["tune", "confirm"] if opts.phase == "tune" and plan else [opts.phase]
    gm.require(plan or opts.phase == "tune", f"no plan {opts.plan}: write (and commit) it first")
    model = train_tldr.resolve_model(opts.model)
    prompts = train_tldr.load_prompts(train_tldr.EMBEDDED)["prompt"][:]
    train, held_out = prompts[:-train_tldr.HELD_OUT], prompts[-train_tldr.HELD_OUT:]
    while True:
        claimed = claim_next(phases, rows_path, claims_path)
        if claimed is None:
            break
        if claimed == "wait":
            time.sleep(20)
            continue
        print(f"worker {opts.worker}: {claimed}", flush=True)
        run_one(claimed[0], *claimed[1], model, train, held_out, rows_path)
    print(f"worker {opts.worker}: no run of {', '.join(phases)} is left", flush=True)


if __name__ == "__main__":
    main()
