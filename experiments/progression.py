"""
A testbed for GRPO with multi-step optimization (TRL PR #2899) where generating dominates a step even on a
CPU: arithmetic progressions, answers of 31 to 39 tokens.

The task: "a+d:" with a in 100..999 and d in 1..9; the answer is the progression's first TERMS terms,
"a,a+d,...,a+7d", then EOS. The 8,100 prompts are split once (a fixed permutation) into three disjoint
sets: HELD_OUT prompts that no stage trains on, GRPO_PROMPTS for GRPO and the rest for the supervised
start. A prompt is short (7 tokens) and its answer long (31 to 39 tokens): generating, one token per call,
costs far more than an update on so few tokens, as on a GPU running HF generate.

The starting model: a LlamaForCausalLM of 2 layers, hidden 64 (about 84k weights), with a character tokenizer
made with `tokenizers`, supervised for SFT_STEPS steps (seeded) on the supervised prompts to a modest
accuracy. `make` trains it and writes it to experiments/progression_model (committed).

    python -m experiments.progression make                      # the starting model and its scores
    python -m experiments.progression probe --arm "μ=1" --lr 1e-4 --seed 101   # one run, its rows printed
    python -m experiments.progression tune --worker 0           # the study (docs/progression/plan.md):
    python -m experiments.progression confirm --worker 0        # one worker per core, resumable
    python -m experiments.progression_report                    # docs/progression/table.md and the data

The runs use experiments/addition.py's machinery (its Reward and Recorder, the rows, the claims, the code
hash) with this task's numbers; their rows go to runs/progression/rows.jsonl.
"""
import argparse, json, os, random, shutil, statistics, tempfile, time, uuid

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import grpo_long_runs as long_runs
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


def dataset(pairs):  # the trainer's train_dataset: the "answer" column reaches the reward function
    return Dataset.from_dict({"prompt": [prompt(a, d) for a, d in pairs],
                              "answer": [answer(a, d) for a, d in pairs]})


def exact_match(completions, answer, **kwargs):
    """1 where the completion (decoded up to its first EOS) is exactly the progression, else 0."""
    return [float(c == a) for c, a in zip(completions, answer)]


# ---- The tokenizer and the starting model ----------------------------------------------------------------
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)
SFT = dict(seed=0, steps=350, batch=64, lr=1e-3)


def make_tokenizer():
    """One token per character: the specials, the digits, '+', ':' and ','; "<bos>" before every text."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list("0123456789+:,"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def make_model(tokenizer, seed):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False, **SHAPE)
    return LlamaForCausalLM(config)


def supervised_batch(tokenizer, pairs):
    """Right-padded "<bos>a+d:" + the terms + "<eos>", the loss on the answer's tokens and the EOS only."""
    ids, labels = [], []
    for a, d in pairs:
        p = tokenizer(prompt(a, d))["input_ids"]
        c = tokenizer(answer(a, d), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    targets = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return input_ids, mask, targets


def train_start(seed=SFT["seed"], steps=SFT["steps"]):
    """The starting model, made from scratch: (model, tokenizer). AdamW on random batches of the supervised
    prompts (seeded), a constant rate."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer, seed)
    pairs, rng = split()["supervised"], random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=SFT["lr"])
    model.train()
    for _ in range(steps):
        input_ids, mask, targets = supervised_batch(tokenizer, rng.sample(pairs, SFT["batch"]))
        model(input_ids=input_ids, attention_mask=mask, labels=targets).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval(), tokenizer


def load_start(folder=MODEL):
    return ad.load_start(folder)


# ---- Held-out accuracy: sampled as training samples ------------------------------------------------------
EVAL_SEED, EVAL_SAMPLES, MAX_COMPLETION = 1234, 2, 40  # the longest answer: 39 tokens with its EOS


def accuracy(model, tokenizer, pairs, samples=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED):
    """Exact-match share over `samples` completions of each prompt, sampled by addition's scorer."""
    texts = ad.completions_of(model, tokenizer, [prompt(a, d) for a, d in pairs], samples, temperature, seed,
                              max_completion=MAX_COMPLETION)
    answers = [answer(a, d) for a, d in pairs for _ in range(samples)]
    return statistics.mean(exact_match(texts, answers))


def held_out_scores(model, tokenizer, pairs):
    return {"sampled": accuracy(model, tokenizer, pairs),
            "greedy": accuracy(model, tokenizer, pairs, temperature=ad.GREEDY_T)}


# ---- One GRPO run ------------------------------------------------------------------------------------------
GROUP, PROMPTS_PER_STEP = 8, 2  # completions per prompt, prompts per mini-batch: 16 completions
STEP_SIZE = GROUP * PROMPTS_PER_STEP
CONFIG = dict(ad.CONFIG, per_device_train_batch_size=STEP_SIZE, max_completion_length=MAX_COMPLETION)
ARMS = {arm: ad.ARMS[arm] for arm in ("μ=1", "μ=2", "μ=4")}
# Held-out scores after this many mini-batches of 16 completions, and the budget of the question.
EVALS, BUDGET = (8, 16, 32, 64), 64


class Reward(ad.Reward):
    rewards, step_size, diag_rows = {"exact": exact_match}, STEP_SIZE, 4  # a quarter of each mini-batch


class Recorder(ad.Recorder):
    eval_batches, budgets, step_size = EVALS, (BUDGET,), STEP_SIZE

    def score(self, model, tokenizer, temperature):
        return accuracy(model, tokenizer, self.held_out, temperature=temperature)


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


def run_one(tags, start, tokenizer, rows_path, max_batches=BUDGET):
    """One run from a copy of the starting model: (arm, lr, seed) from tags, its rows appended to
    rows_path."""
    out = tempfile.mkdtemp(prefix="progression-")
    try:
        arm = tags["arm"]
        config = long_runs.GRPOConfig(**CONFIG, **ARMS[arm], learning_rate=tags["lr"], seed=tags["seed"],
                                      max_steps=max_batches * ARMS[arm]["num_iterations"], output_dir=out)
        fn = Reward("exact", config)
        trainer = Run(ad.copy_model(start), [fn], args=config, train_dataset=dataset(split()["grpo"]),
                         processing_class=tokenizer)
        fn.model, fn.tokenizer = trainer.model, trainer.tokenizer
        trainer.recorder = Recorder({**tags, "attempt": uuid.uuid4().hex[:8]}, fn, split()["held_out"],
                                    rows_path)
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)


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


def work(command, worker, folder=ROWS):
    """Run the command's runs until none is left; another worker may share the folder."""
    version = ad.code_version(CODE)
    rows_path, claims_path = os.path.join(folder, "rows.jsonl"), os.path.join(folder, "claims.jsonl")
    os.makedirs(folder, exist_ok=True)
    rows = ad.read(rows_path)
    if command == "confirm":
        committed = ad.git("ls-files", PLAN) and not ad.git("status", "--porcelain", "--", PLAN)
        require(committed, f"{PLAN} is not committed: the plan comes first")
        require(set(chosen_rates(rows)) == set(ARMS), "the tuning is not over: run tune first")
    codes = {r["code"] for r in rows}
    require(codes <= {version["code"]}, f"the rows so far ran at code {sorted(codes)}, this is "
            f"{version['code']} (commit {version['commit'][:7]}): one study, one version of the code")
    start, tokenizer = load_start()
    while True:
        claimed = ad.claim_next([command], rows_path, claims_path, planned)
        if claimed is None:
            break
        if claimed == "wait":
            time.sleep(15)
            continue
        phase, arm, lr, seed = claimed
        print(f"worker {worker}: {phase} {arm} lr={lr:g} seed={seed}", flush=True)
        run_one({"phase": phase, "arm": arm, "lr": lr, "seed": seed, **version}, start, tokenizer, rows_path)
    print(f"worker {worker}: no {command} run is left", flush=True)


# ---- Commands ---------------------------------------------------------------------------------------------
def make(folder=MODEL):
    """Train the starting model, save it with its tokenizer, and its held-out scores beside it."""
    began, cpu = time.perf_counter(), time.process_time()
    model, tokenizer = train_start()
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    scores = held_out_scores(model, tokenizer, split()["held_out"])
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {**scores, "sft": SFT, "train_seconds": round(seconds, 1),
            "train_cpu_seconds": round(cpu_seconds, 1),
            "samples": EVAL_SAMPLES, "held_out_prompts": len(split()["held_out"]), "eval_seed": EVAL_SEED,
            "weights": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(folder, "start.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def probe(arm, lr, seed, batches, rows_path):
    """One run, its rows printed at its end (a quick look, or one confirmation cell checked)."""
    start, tokenizer = load_start()
    run_one({"phase": "probe", "arm": arm, "lr": lr, "seed": seed}, start, tokenizer, rows_path,
            max_batches=batches)
    for row in ad.read(rows_path):
        print(json.dumps(row, ensure_ascii=False))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["make", "probe", "tune", "confirm"])
    p.add_argument("--worker", type=int, default=0, help="a name for this worker's lines")
    p.add_argument("--rows", default=ROWS, help="the folder of rows.jsonl and claims.jsonl")
    p.add_argument("--arm", default="μ=1", choices=list(ARMS))
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=BUDGET)
    opts = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if opts.command == "make":
        print(json.dumps(make(), indent=1))
    elif opts.command in ("tune", "confirm"):
        work(opts.command, opts.worker, opts.rows)
    else:
        folder = tempfile.mkdtemp(prefix="progression-probe-")
        probe(opts.arm, opts.lr, opts.seed, opts.batches, os.path.join(folder, "rows.jsonl"))
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
