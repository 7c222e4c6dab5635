"""
What μ buys per update: the length reward −|40 − len| (TRL PR #2899's uses 100) on SmolLM2-135M-Instruct,
every run bounded by optimizer steps (never by seconds) and scored on the same held-out prompts at the same
steps, so that the curves do not depend on this machine's speed or on what else runs on it.

Arms: μ = num_iterations ∈ {1, 2, 4} at steps_per_generation = gradient_accumulation_steps, and
steps_per_generation = 4 × gradient_accumulation_steps at μ = 1 (TRL's other reading of multi-step).
Each arm at its learning rates (RATES, or --lrs), with --seeds seeds. Every optimizer step writes a row to
rows.jsonl (arm, lr, seed, step, completions generated, its training reward and clip fraction), and every
--eval-every steps the held-out reward: the HELD_OUT posts of train_tldr.py (never trained on), 2
completions each, scored by experiments/heldout.py (decoded as in training, from one fixed seed, the same for
every arm and step). The rows go to runs/update-clock/rows.jsonl (--rows), outside docs/: docs/update-clock
holds the committed study's rows, which were scored with the tokenizer's EOS alone (for this model the
same single id).

    python -m experiments.update_clock --worker 0 --workers 2 &   # one per core (taskset -c 0 / 1)
    python -m experiments.update_clock --worker 1 --workers 2 &
    python -m experiments.report_update_clock runs/update-clock/rows.jsonl   # the table and the chart

Resumable: a run whose last row says "end" is kept; any other is run again from the start (a run is
two minutes), so that the command can be repeated until every run has ended.
"""
import argparse, fcntl, json, math, os, shutil, tempfile

import grpo_multistep as gm
import train_tldr
from experiments.heldout import held_out_score
from experiments.metric_names import clip_fraction, metric

ARMS = {"μ=1": dict(num_iterations=1), "μ=2": dict(num_iterations=2), "μ=4": dict(num_iterations=4),
        "S=4": dict(num_iterations=1, steps_per_generation=4)}  # S: steps_per_generation / grad. accumulation
# Each arm's rates, a factor 2 apart around its best: 2 seeds of the grid 5e-6 ... 8e-5 put μ = 1's best at
# 2e-5, μ = 2's and μ = 4's at 4e-5 and S = 4's at 8e-5 (5e-6 was every arm's worst: a pilot, not rerun).
# With 6 seeds μ = 4 did best at 8e-5, its top, then (3 seeds) at 1.6e-4: 1.6e-4 and 3.2e-4 were added.
RATES = {"μ=1": [1e-5, 2e-5, 4e-5], "μ=2": [2e-5, 4e-5, 8e-5], "μ=4": [2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4],
         "S=4": [4e-5, 8e-5, 1.6e-4]}
SHAPE = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, num_generations=8,
             max_prompt_length=128, max_completion_length=32, temperature=1.0, beta=0.0,
             lr_scheduler_type="constant", logging_steps=1, save_steps=10**6, overwrite_output_dir=True)
EVAL_SAMPLES, TARGET_CHARS = 2, 40
ROWS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "update-clock",
                    "rows.jsonl")


class Run(gm.GRPOTrainer):
    def log(self, metrics):
        a, S = self.args, gm.mini_batches_per_generation(self.args)
        cycle, per_batch = (a.num_iterations * S,
                            a.per_device_train_batch_size * a.gradient_accumulation_steps * S)
        step = metrics["step"]
        row = {**self.tags, "step": step, "completions": math.ceil(step / cycle) * per_batch,
               "first_use": (step - 1) % cycle < S,  # a mini-batch's first use (its ratio starts at 1)
               "clip": clip_fraction(metrics), "train_reward": metrics.get("reward"),
               "completion_length": metric(metrics, "completions/mean_length")}
        if step % self.eval_every == 0 or step == a.max_steps:
            row.update(held_out_score(self, self.held_out, EVAL_SAMPLES))
        row["end"] = step == a.max_steps
        append(self.rows, row)


def append(path, row):  # two workers append to one file: a lock per line
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(row) + "\n")


def read(path):
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", type=float, nargs="+", help="the same rates for every arm (default: RATES)")
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--max-steps", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--model", default=train_tldr.OFFLINE_MODEL)
    p.add_argument("--worker", type=int, default=0)
    p.add_argument("--workers", type=int, default=1)
    opts = p.parse_args(argv)
    for flag, ok, rule in [("--seeds", opts.seeds >= 1, "must be >= 1"), ("--max-steps", opts.max_steps >= 1,
                            "must be >= 1"), ("--eval-every", opts.eval_every >= 1, "must be >= 1"),
                           ("--workers", opts.workers >= 1, "must be >= 1"),
                           ("--worker", 0 <= opts.worker < opts.workers, "must lie in [0, --workers)")]:
        if not ok:
            p.error(f"{flag} {rule}")
    os.makedirs(os.path.dirname(opts.rows), exist_ok=True)
    model = train_tldr.resolve_model(opts.model)
    prompts = train_tldr.load_prompts(train_tldr.EMBEDDED)["prompt"][:]
    train, held_out = prompts[:-train_tldr.HELD_OUT], prompts[-train_tldr.HELD_OUT:]
    reward = train_tldr.length_reward(TARGET_CHARS)
    rows = read(opts.rows)
    done = {(r["arm"], r["lr"], r["seed"]) for r in rows if r["end"]}
    first = opts.worker == 0 and not any(r["step"] == 0 for r in rows)  # the untrained model, once
    # Seed-major: a sweep cut short has every cell at fewer seeds, not some cells at none.
    runs = [(arm, lr, 42 + s) for s in range(opts.seeds) for arm in opts.arms
            for lr in opts.lrs or RATES[arm]]
    for i, (arm, lr, seed) in enumerate(runs):
        if i % opts.workers != opts.worker or (arm, lr, seed) in done:
            continue
        out = tempfile.mkdtemp(prefix="update-clock-")
        config = gm.GRPOConfig(**SHAPE, **ARMS[arm], learning_rate=lr, seed=seed, max_steps=opts.max_steps,
                               output_dir=out)
        trainer = Run(model, reward, args=config, train_dataset=gm.Dataset.from_dict({"prompt": train}))
        trainer.tags, trainer.rows, trainer.eval_every = ({"arm": arm, "lr": lr, "seed": seed}, opts.rows,
                                                          opts.eval_every)
        trainer.held_out = held_out
        if first:  # the same for every arm, rate and seed: the weights and the random numbers are
            append(opts.rows, {"arm": None, "lr": None, "seed": None, "step": 0, "completions": 0,
                               **held_out_score(trainer, held_out, EVAL_SAMPLES), "end": False})
            first = False
        print(f"run {i + 1}/{len(runs)}: {arm} lr={lr:g} seed={seed}", flush=True)
        try:
            trainer.train()
        finally:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
