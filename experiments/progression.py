"""
A testbed for GRPO with multi-step optimization (TRL PR #2899) where generating dominates a step even on a
CPU: arithmetic progressions, answers of 32 to 39 tokens with the EOS.

The task: "a+d:" with a in 100..999 and d in 1..9; the answer is the progression's first TERMS terms,
"a,a+d,...,a+7d", then EOS. The 8,100 prompts are split once (a fixed permutation) into three disjoint
sets: HELD_OUT prompts that no stage trains on, GRPO_PROMPTS for GRPO and the rest for the supervised
start. A prompt is short (7 tokens) and its answer long (32 to 39 tokens): generating, one token per call,
costs far more than an update on so few tokens, as on a GPU running HF generate.

The starting model: a LlamaForCausalLM of 2 layers, hidden 64 (about 84k weights), with a character tokenizer
made with `tokenizers`, supervised for SFT_STEPS steps (seeded) on the supervised prompts to a modest
accuracy. `make` trains it and writes it to experiments/progression_model (committed).

    python -m experiments.progression make                      # the starting model and its scores
    python -m experiments.progression probe --arm "μ=1" --lr 1e-4 --seed 101   # one run, its rows printed
    python -m experiments.progression tune --worker 0           # the study (docs/progression/plan.md):
    python -m experiments.progression confirm --worker 0        # one worker per core, resumable
    python -m experiments.progression_report                    # docs/progression/table.md and the data

The starting model and the runs use experiments/addition.py's machinery (its tokenizer, model, supervised
start and scorer, its Reward, Recorder and Run, the rows, the claims, the code hash and the commands) with
this task's characters and numbers; the rows go to runs/progression/rows.jsonl.
"""
import os, random, time

from experiments import addition as ad

ROOT = ad.ROOT
FOLDER = os.path.join(ROOT, "docs", "progression")  # the study's pages: plan, report and chart
RESULTS = os.path.join(ROOT, "experiments", "progression_results")  # the report's data
MODEL = os.path.join(ROOT, "experiments", "progression_model")  # the starting model, beside this file
ROWS = os.path.join(ROOT, "runs", "progression")
PLAN = "docs/progression/plan.md"
require = ad.require

# ---- The task -------------------------------------------------------------------------------------------
TERMS, SPLIT_SEED, HELD_OUT, GRPO_PROMPTS = 8, 0, 256, 2048  # the rest (5,796) are supervised


def split():
    """{"held_out", "grpo", "supervised"}: disjoint lists of (a, d), from one fixed permutation."""
    pairs = [(a, d) for a in range(100, 1000) for d in range(1, 10)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return {"held_out": sorted(pairs[:HELD_OUT]), "grpo": sorted(pairs[HELD_OUT:HELD_OUT + GRPO_PROMPTS]),
            "supervised": sorted(pairs[HELD_OUT + GRPO_PROMPTS:])}


def prompt(a, d):
    return f"{a}+{d}:"


def answer(a, d):
    return ",".join(str(a + k * d) for k in range(TERMS))


exact_match = ad.exact_match  # addition's: 1 where the completion is exactly the progression, else 0

# ---- The tokenizer and the starting model: addition's, with this task's characters and numbers ----------
CHARACTERS = "0123456789+:,"
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)
SFT = dict(seed=0, steps=350, batch=64, lr=1e-3)
MAX_COMPLETION = 40  # the longest answer: 39 tokens with its EOS
TASK = ad.Task(prompt, answer, split, CHARACTERS, SHAPE, SFT, MAX_COMPLETION)
# What `make` writes into start.json: addition's record, with the CPU seconds and the weights.
RECORD = ("sampled", "greedy", "sft", "train_seconds", "train_cpu_seconds", "samples", "held_out_prompts",
          "eval_seed", "weights")


def make_tokenizer():
    return ad.make_tokenizer(CHARACTERS)


def load_start(folder=MODEL):
    return ad.load_start(folder)


# ---- One GRPO run: addition's, with this task's mini-batch, evaluations and trainer ---------------------
GROUP, PROMPTS_PER_STEP = 8, 2  # completions per prompt, prompts per mini-batch: 16 completions
STEP_SIZE = GROUP * PROMPTS_PER_STEP
CONFIG = dict(ad.CONFIG, per_device_train_batch_size=STEP_SIZE, max_completion_length=MAX_COMPLETION)
ARMS = {arm: ad.ARMS[arm] for arm in ("μ=1", "μ=2", "μ=4")}
REWARDS = {"exact": exact_match}
# Held-out scores after this many mini-batches of 16 completions, and the budget of the question.
EVALS, BUDGET = (8, 16, 32, 64), 64


class Reward(ad.Reward):
    rewards, step_size, diag_rows = REWARDS, STEP_SIZE, 4  # a quarter of each mini-batch


class Recorder(ad.Recorder):
    eval_batches, budgets, step_size, task = EVALS, (BUDGET,), STEP_SIZE, TASK


class Run(ad.Run):
    """addition's run, which also logs generation's CPU seconds (time_cpu_generate, this process's CPU time:
    other work on the core does not lengthen it, as it does the trainer's wall-clock time_generate), less the
    π_old pass and the diagnostics' share of the reward call, as the trainer's time_generate leaves out its
    π_old pass."""
    cpu_generate = 0.0

    def generate_and_score(self, k):
        start, kept = time.process_time(), self.recorder.reward.cpu_seconds
        logps_before = self.cpu_logps
        result = super().generate_and_score(k)
        outside = (self.cpu_logps - logps_before) + (self.recorder.reward.cpu_seconds - kept)
        self.cpu_generate += time.process_time() - start - outside
        return result

    def cached_logps(self, model, batch):
        start = time.process_time()
        result = super().cached_logps(model, batch)
        self.cpu_logps += time.process_time() - start
        return result

    cpu_logps = 0.0

    def log(self, metrics):
        metrics["time_cpu_generate"] = self.cpu_generate
        self.cpu_generate = 0.0
        super().log(metrics)


PROGRESSION = ad.Testbed("progression", TASK, MODEL, CONFIG, Run, Reward, Recorder)


def run_one(tags, start, tokenizer, rows_path, max_batches=BUDGET):
    """One run from a copy of the starting model: (arm, lr, seed) from tags, its rows appended to
    rows_path."""
    ad.run_one(tags, start, tokenizer, rows_path, max_batches=max_batches, bed=PROGRESSION)


# ---- The study (docs/progression/plan.md) ------------------------------------------------------------------
GRID, FACTOR, MAX_RATES = (2.5e-5, 5e-5, 1e-4), 2.0, 6
SEEDS = {"tune": (1, 2), "confirm": tuple(range(101, 121))}
CODE = ["grpo_multistep.py", "grpo_long_runs.py", "experiments/addition.py", "experiments/progression.py",
        "experiments/progression_model"]


def tuning_scores(rows):
    """{arm: {lr: {seed: held-out accuracy at the budget}}} of the finished tuning runs."""
    out = {}
    for (phase, arm, lr, seed), run in ad.finished_runs(rows).items():
        if phase == "tune":
            out.setdefault(arm, {}).setdefault(lr, {})[seed] = run[-1]["accuracy"]
    return out


def tuning_grid(arm, rows):
    """The arm's rates: GRID, and a factor FACTOR beyond an edge wherever the best mean lies on it, once
    every rate so far has every tuning seed (at most MAX_RATES)."""
    grid = set(GRID)
    at = ad.means(tuning_scores(rows).get(arm, {}), SEEDS["tune"])
    while len(grid) < MAX_RATES and set(at) >= grid:
        best = max(grid, key=lambda lr: at[lr])
        if best == min(grid):
            grid.add(best / FACTOR)
        elif best == max(grid):
            grid.add(best * FACTOR)
        else:
            break
    return sorted(grid)


def chosen_rates(rows):
    """{arm: lr} for the arms whose tuning is over: the best mean over the tuning seeds, strictly inside."""
    chosen = {}
    for arm in ARMS:
        grid = tuning_grid(arm, rows)
        at = ad.means(tuning_scores(rows).get(arm, {}), SEEDS["tune"])
        if set(at) >= set(grid):
            best = max(grid, key=lambda lr: at[lr])
            if min(grid) < best < max(grid):
                chosen[arm] = best
    return chosen


def planned(phase, rows):
    """The phase's runs (arm, lr, seed), seed by seed: a phase cut short has every arm at fewer seeds."""
    if phase == "tune":
        grids = {arm: tuning_grid(arm, rows) for arm in ARMS}
        return [(arm, lr, seed) for seed in SEEDS[phase] for arm in ARMS for lr in grids[arm]]
    chosen = chosen_rates(rows)
    return [(arm, chosen[arm], seed) for seed in SEEDS[phase] for arm in ARMS if arm in chosen]


def run_length(phase, arm, lr, rows):
    """Every run goes to the budget."""
    return BUDGET


def work(command, worker, folder=ROWS):
    """Run the command's runs until none is left; another worker may share the folder."""
    version = ad.code_version(CODE)
    os.makedirs(folder, exist_ok=True)
    rows = ad.read(os.path.join(folder, "rows.jsonl"))
    if command == "confirm":
        committed = ad.git("ls-files", PLAN) and not ad.git("status", "--porcelain", "--", PLAN)
        require(committed, f"{PLAN} is not committed: the plan comes first")
        require(set(chosen_rates(rows)) == set(ARMS), "the tuning is not over: run tune first")
    codes = {r["code"] for r in rows}
    require(codes <= {version["code"]}, f"the rows so far ran at code {sorted(codes)}, this is "
            f"{version['code']} (commit {version['commit'][:7]}): one study, one version of the code")
    ad.serve([command], worker, folder, version, PROGRESSION, planned, run_length)


# ---- Commands: addition's, with this testbed's task, record and runs -------------------------------------
def make(folder=MODEL):
    """Train the starting model, save it with its tokenizer, and its held-out scores beside it."""
    return ad.make(folder, TASK, RECORD)


def main(argv=None):
    opts = ad.parser(__doc__, ARMS, 5e-4, BUDGET, ROWS, REWARDS).parse_args(argv)
    ad.command(opts, PROGRESSION, make, work)


if __name__ == "__main__":
    main()
