"""
A fast verifiable testbed for GRPO with multi-step optimization (TRL PR #2899): 2-digit additions.

The task: "a+b=" with a, b in 0..99; the answer is the sum's digits, then EOS. The 5,050 unordered pairs
{a, b} are split once (a fixed permutation) into three disjoint sets, and both orders of a pair go to the
same set: HELD_OUT pairs that no stage trains on, GRPO_PAIRS for GRPO's prompts and the rest for the
supervised start. The held-out accuracy thus measures additions that neither stage has seen, in either
order.

The starting model: a LlamaForCausalLM of 2 layers, hidden 128 (about 333k weights), with a character
tokenizer made with `tokenizers`, supervised for SFT_STEPS steps (seeded) on the supervised pairs to a
modest accuracy. `make` trains it and writes it to experiments/addition_model (1.3 MB, committed); every run
starts from those files.

    python -m experiments.addition make              # the starting model, and its held-out accuracy
    python -m experiments.addition probe --mu 1 --lr 1e-4 --batches 100   # one run, its curve printed
    python -m experiments.addition tune --worker 0   # the study's phases (docs/addition/plan.md);
    python -m experiments.addition confirm --worker 0  # one worker per core, resumable, shared rows
    python -m experiments.addition_report  # docs/addition: table.md, accuracy.png; addition_results: the data

A run trains through grpo_multistep's GRPOTrainer in a temporary output_dir, deleted afterwards; it
writes only its rows (runs/addition/rows.jsonl while it runs). Held-out accuracy is scored by one function
that samples as training does (grpo_multistep's tokenize_prompts and generate_completions, the decode up
to the first EOS) from one fixed seed, inside torch.random.fork_rng, so that scoring leaves the run's own
random stream untouched.
"""
import argparse, fcntl, hashlib, json, os, random, shutil, statistics, subprocess, tempfile, time, uuid
from collections import namedtuple
from contextlib import contextmanager

import torch
from datasets import Dataset
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import grpo_long_runs as long_runs
import grpo_multistep as gm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, "docs", "addition")  # the study's pages: plan, report (table.md) and chart
RESULTS = os.path.join(ROOT, "experiments", "addition_results")  # the report's data: rows.jsonl, summary.json
MODEL = os.path.join(ROOT, "experiments", "addition_model")  # the starting model, beside this file
ROWS = os.path.join(ROOT, "runs", "addition")


def require(ok, message):  # a bad input or state fails at once, named
    if not ok:
        raise ValueError(message)

# ---- The task -------------------------------------------------------------------------------------------
SPLIT_SEED, HELD_OUT, GRPO_PAIRS = 0, 250, 1000  # unordered pairs; the rest (3,800) are supervised


def split():
    """{"held_out", "grpo", "supervised"}: lists of (a, b), both orders of each unordered pair in one set."""
    pairs = [(a, b) for a in range(100) for b in range(a, 100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    parts = {"held_out": pairs[:HELD_OUT], "grpo": pairs[HELD_OUT:HELD_OUT + GRPO_PAIRS],
             "supervised": pairs[HELD_OUT + GRPO_PAIRS:]}
    ordered = {}
    for name, part in parts.items():
        both = [(a, b) for a, b in part] + [(b, a) for a, b in part if a != b]
        ordered[name] = sorted(both)
    return ordered


def prompt(a, b):
    return f"{a}+{b}="


def answer(a, b):
    return str(a + b)


def dataset(pairs, prompt=prompt, answer=answer):
    """The trainer's train_dataset: the "answer" column reaches the reward functions."""
    return Dataset.from_dict({"prompt": [prompt(a, b) for a, b in pairs],
                              "answer": [answer(a, b) for a, b in pairs]})


# ---- Rewards: exact match, and per-digit partial credit as an option --------------------------------------
def exact_match(completions, answer, **kwargs):
    """1 where the completion (decoded up to its first EOS) is exactly the answer, else 0."""
    return [float(c == a) for c, a in zip(completions, answer)]


def digit_credit(completions, answer, **kwargs):
    """The share of positions, from the left, where completion and answer agree, over the longer of the two:
    "46" for 46 scores 1, "47" and "4" score 1/2, "461" 2/3, "" 0."""
    return [sum(x == y for x, y in zip(c, a)) / max(len(c), len(a)) for c, a in zip(completions, answer)]


REWARDS = {"exact": exact_match, "digits": digit_credit}

# ---- The tokenizer and the starting model ------------------------------------------------------------------
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = "0123456789+="
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=32)
SFT = dict(seed=0, steps=600, batch=64, lr=1e-3)
MAX_COMPLETION = 6  # completion tokens at most, in scoring as in training: room for 3 digits and the EOS
# A testbed's task, its starting model and the length of its answers: another testbed passes its own to the
# functions that make the starting model and score it.
Task = namedtuple("Task", "prompt answer split characters shape sft max_completion")
TASK = Task(prompt, answer, split, CHARACTERS, SHAPE, SFT, MAX_COMPLETION)


def make_tokenizer(characters=CHARACTERS):
    """One token per character: the specials and the task's characters (here the digits, '+' and '=');
    "<bos>" before every text."""
    vocab = {t: i for i, t in enumerate(SPECIALS + list(characters))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def make_model(tokenizer, seed, shape=SHAPE):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False, **shape)
    return LlamaForCausalLM(config)


def supervised_batch(tokenizer, pairs, prompt=prompt, answer=answer):
    """Right-padded "<bos>" + prompt + answer + "<eos>", the loss on the answer's tokens and the EOS only."""
    ids, labels = [], []
    for a, b in pairs:
        p = tokenizer(prompt(a, b))["input_ids"]
        c = tokenizer(answer(a, b), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, ids))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    targets = torch.tensor([x + [-100] * (width - len(x)) for x in labels])
    return input_ids, mask, targets


def supervise(model, tokenizer, pairs, steps, seed, task=TASK):
    """AdamW on random batches of the supervised pairs (seeded), the task's batch size, a constant rate."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=task.sft["lr"])
    model.train()
    for _ in range(steps):
        batch = rng.sample(pairs, task.sft["batch"])
        input_ids, mask, targets = supervised_batch(tokenizer, batch, task.prompt, task.answer)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def train_start(seed=SFT["seed"], steps=SFT["steps"], task=TASK):
    """The task's starting model, made from scratch: (model, tokenizer)."""
    tokenizer = make_tokenizer(task.characters)
    model = make_model(tokenizer, seed, task.shape)
    supervise(model, tokenizer, task.split()["supervised"], steps, seed, task)
    return model.eval(), tokenizer


def load_start(folder=MODEL):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model, tokenizer


# ---- Held-out accuracy: sampled as training samples ------------------------------------------------------
EVAL_SEED, EVAL_SAMPLES = 1234, 2
GREEDY_T = 1e-4  # "greedy": the same sampler at T = 1e-4, where a second token's chance is e^-(1e4 · gap)


def completions_of(model, tokenizer, prompts, samples, temperature, seed, max_completion=MAX_COMPLETION):
    """`samples` completions per prompt, decoded as the trainer decodes them (up to and including the first
    EOS, special tokens skipped), from `seed` inside fork_rng: the caller's random stream goes on as if
    nothing had been drawn."""
    args = long_runs.GRPOConfig(output_dir=tempfile.gettempdir(), num_generations=samples,
                         max_completion_length=max_completion, temperature=temperature)
    ids, mask = gm.tokenize_prompts(tokenizer, prompts, None)
    eos = torch.tensor([tokenizer.eos_token_id])
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        _, _, completion_ids, completion_mask = gm.generate_completions(model, tokenizer, ids, mask, args,
                                                                        eos)
    model.train(was_training)
    rows = [r[:n] for r, n in zip(completion_ids.tolist(), completion_mask.sum(1).tolist())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def accuracy(model, tokenizer, pairs, samples=EVAL_SAMPLES, temperature=1.0, seed=EVAL_SEED, task=TASK):
    """Exact-match share over `samples` completions of each pair's prompt."""
    prompts = [task.prompt(a, b) for a, b in pairs]
    texts = completions_of(model, tokenizer, prompts, samples, temperature, seed, task.max_completion)
    answers = [task.answer(a, b) for a, b in pairs for _ in range(samples)]
    return statistics.mean(exact_match(texts, answers))


def held_out_scores(model, tokenizer, pairs, task=TASK):
    return {"sampled": accuracy(model, tokenizer, pairs, task=task),
            "greedy": accuracy(model, tokenizer, pairs, samples=2, temperature=GREEDY_T, task=task)}


# ---- The metrics the trainer logs, under TRL's names or this trainer's older ones -----------------------
def metric(metrics, name):
    """One logged value by its meaning: "clip" (the share of tokens whose gradient the clip removed),
    "reward", "length" (mean completion tokens), "entropy"; None where the step did not log it."""
    if name == "clip":
        if "clip_ratio/region_mean" in metrics:
            return metrics["clip_ratio/region_mean"]
        low = metrics.get("clip_ratio/low_mean", metrics.get("clip_ratio_low"))
        high = metrics.get("clip_ratio/high_mean", metrics.get("clip_ratio_high"))
        return None if low is None or high is None else low + high
    if name == "length":
        return metrics.get("completions/mean_length", metrics.get("completion_length"))
    return metrics.get(name)


# ---- One GRPO run, scored on the held-out pairs as it goes -------------------------------------------------
GROUP, PROMPTS_PER_STEP = 8, 8  # completions per prompt, prompts per optimizer step: 64 completions a step
STEP_SIZE = GROUP * PROMPTS_PER_STEP
CONFIG = dict(per_device_train_batch_size=STEP_SIZE, gradient_accumulation_steps=1, num_generations=GROUP,
              max_prompt_length=8, max_completion_length=MAX_COMPLETION, temperature=1.0, beta=0.0,
              loss_type="grpo", lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
              overwrite_output_dir=True)
DIAG_ROWS = 16  # completions of each mini-batch that the diagnostics measure: a quarter, for their cost
CLIP_OFF = dict(epsilon=1 - 1e-9, epsilon_high=1e9)  # the ratio kept in [1e-9, 1e9]: no clip in effect
ARMS = {"μ=1": dict(num_iterations=1), "μ=2": dict(num_iterations=2), "μ=4": dict(num_iterations=4),
        "μ=8": dict(num_iterations=8), "S=4": dict(num_iterations=1, steps_per_generation=4),
        "μ=4 no clip": dict(num_iterations=4, **CLIP_OFF)}
# Held-out scores after this many mini-batches of 64 completions generated (multiples of S = 4), and the
# budgets of the question among them: 2,048 and 8,192 completions.
EVALS, BUDGETS = (4, 8, 16, 32, 64, 128), (32, 128)


def cycle(arm):
    """(S, μ·S): mini-batches per generation batch, and optimizer steps per generation batch."""
    S = ARMS[arm].get("steps_per_generation", 1)
    return S, ARMS[arm]["num_iterations"] * S


def steps_at(arm, batches):
    """The optimizer steps after which an arm has generated batches × 64 completions and taken every step
    that they serve: μ per mini-batch of 64."""
    S, steps = cycle(arm)
    require(batches % S == 0, f"{batches} mini-batches are not whole generation batches of {arm}")
    return batches * ARMS[arm]["num_iterations"]


def token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """log π(o_t | q, o_<t) by its definition (one forward pass, no gradient): (N, C)."""
    ids, mask = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, prompt_ids.size(1) - 1:-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)


class Reward:
    """The reward function the trainer calls, which also keeps each generation batch's completions and
    π_old's log-probs of them (the policy that sampled them: no update has been made since) for the
    diagnostics of the steps that reuse them. The trainer sees a function named after the reward. Another
    testbed changes its class attributes: its rewards, and its mini-batch's size."""
    rewards, step_size, diag_rows = REWARDS, STEP_SIZE, DIAG_ROWS

    def __init__(self, name, trainer_args):
        self.reward, self.__name__, self.args = self.rewards[name], self.rewards[name].__name__, trainer_args
        self.model, self.tokenizer, self.batch = None, None, None
        self.seconds, self.cpu_seconds = 0.0, 0.0  # spent keeping π_old's log-probs: not training's time

    def __call__(self, prompts, completions, completion_ids, answer, **kwargs):
        if self.args.num_iterations * (self.args.steps_per_generation or 1) > 1:
            self.batch = self.keep(prompts, completion_ids)
        return self.reward(completions, answer)

    def keep(self, prompts, completion_ids):
        """The first DIAG_ROWS completions (DIAG_ROWS / 8 prompts' groups) of each mini-batch of 64."""
        start, cpu = time.perf_counter(), time.process_time()
        rows = [i for i in range(len(prompts)) if i % self.step_size < self.diag_rows]
        prompt_ids, prompt_mask = gm.tokenize_prompts(self.tokenizer, [prompts[i] for i in rows], None)
        kept = [completion_ids[i] for i in rows]
        width = max(map(len, kept))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([c + [pad] * (width - len(c)) for c in kept])
        mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in kept])
        old = token_logps(self.model, prompt_ids, prompt_mask, ids, mask, self.args.temperature)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "ids": ids, "mask": mask, "old": old}

    def drift(self, mini_batch):
        """On the kept completions of mini-batch `mini_batch`, under the current policy π_θ: the k3 estimate
        of KL(π_old ‖ π_θ) (completions sampled from π_old; ρ = π_θ / π_old; k3 = ρ - 1 - log ρ), a token
        mean, and the share of tokens whose ρ lies outside [0.8, 1.2] (ε = 0.2's range)."""
        rows = self.diag_rows
        b = {k: v[mini_batch * rows:(mini_batch + 1) * rows] for k, v in self.batch.items()}
        logps = token_logps(self.model, b["prompt_ids"], b["prompt_mask"], b["ids"], b["mask"],
                            self.args.temperature)
        log_ratio = (logps - b["old"]) * b["mask"]
        tokens = b["mask"].sum()
        k3 = ((log_ratio.exp() - 1 - log_ratio) * b["mask"]).sum() / tokens
        outside = (((log_ratio.exp() - 1).abs() > 0.2) & (b["mask"] > 0)).sum() / tokens
        return float(k3), float(outside)


class Recorder:
    """A run's rows. At each step it keeps the step's diagnostics by its place in the generation batch (j =
    the updates made since its completions were sampled); at each of EVALS it writes one row: the held-out
    accuracy and the diagnostics' means since the last row. Its own object, so that no name of it can
    shadow one of the trainer's. Another testbed changes its class attributes: its evaluations, its
    mini-batch's size and the task it scores."""
    eval_batches, budgets, step_size, task = EVALS, BUDGETS, STEP_SIZE, TASK

    def __init__(self, tags, reward, held_out, rows_path):
        self.tags, self.reward, self.held_out, self.rows_path = tags, reward, held_out, rows_path
        self.S, self.cycle = cycle(tags["arm"])
        self.evals = {steps_at(tags["arm"], k): k for k in self.eval_batches}
        self.steps = 0  # counted here: log() is called once a step (logging_steps=1)
        self.pending = (0.0, 0.0)  # the next step's drift, measured before it
        # Seconds spent outside training (scoring, diagnostics), taken off the clocks: the wall clock, and
        # this process's CPU time, which other work on a shared core does not lengthen.
        self.extra, self.cpu_extra = 0.0, 0.0
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()
        self.window = self.empty_window()

    def empty_window(self):
        return {"clip": [[] for _ in range(self.cycle)], "kl": [[] for _ in range(self.cycle)],
                "outside": [[] for _ in range(self.cycle)], "reward": [], "length": [], "time": {},
                "kept": self.reward.seconds}

    def log(self, trainer, metrics):
        start, cpu = time.perf_counter(), time.process_time()
        self.steps += 1
        step, j, w = self.steps, (self.steps - 1) % self.cycle, self.window
        if metric(metrics, "clip") is not None:
            w["clip"][j].append(metric(metrics, "clip"))
        w["kl"][j].append(self.pending[0])
        w["outside"][j].append(self.pending[1])
        for name in ("reward", "length"):
            value = metric(metrics, name)
            if value is not None and value == value:  # on the steps that generated (else None, or NaN)
                w[name].append(value)
        for name, seconds in metrics.items():  # the trainer's seconds per phase, where it logs them
            if name.startswith("time_"):
                w["time"][name[5:]] = w["time"].get(name[5:], 0.0) + seconds
        # Before the next step: how far π_θ has moved from π_old on the mini-batch that the step will use.
        if step % self.cycle == 0:
            self.pending = (0.0, 0.0)  # the next step samples anew: ρ = 1 exactly
        else:
            self.pending = self.reward.drift(step % self.cycle % self.S)
        if step in self.evals:
            self.write_row(trainer, step, metrics)
        self.extra += time.perf_counter() - start
        self.cpu_extra += time.process_time() - cpu

    def write_row(self, trainer, step, metrics):
        w, mean = self.window, lambda xs: statistics.mean(xs) if xs else None
        row = {**self.tags, "step": step, "completions": self.evals[step] * self.step_size,
               "seconds": round(time.perf_counter() - self.clock - self.extra - self.reward.seconds, 3),
               "cpu_seconds": round(time.process_time() - self.cpu_clock - self.cpu_extra
                                    - self.reward.cpu_seconds, 3),
               "train_reward": mean(w["reward"]), "length": mean(w["length"]),
               "clip": [mean(x) for x in w["clip"]], "kl": [mean(x) for x in w["kl"]],
               "outside": [mean(x) for x in w["outside"]], "entropy": metric(metrics, "entropy"),
               "time": {**w["time"], "kept": self.reward.seconds - w["kept"]},
               "accuracy": self.score(trainer.model, trainer.tokenizer, 1.0)}
        if self.evals[step] in self.budgets:
            row["greedy"] = self.score(trainer.model, trainer.tokenizer, GREEDY_T)
        row["end"] = step == trainer.args.max_steps
        append(self.rows_path, row)
        self.window = self.empty_window()

    def score(self, model, tokenizer, temperature):
        """Held-out accuracy at the temperature (1: the plan's score; GREEDY_T: greedy)."""
        return accuracy(model, tokenizer, self.held_out, temperature=temperature, task=self.task)


class Run(long_runs.GRPOTrainer):
    def log(self, metrics):  # instead of the trainer's own: no line printed, no output_dir/metrics.jsonl
        self.recorder.log(self, metrics)


# What one testbed runs GRPO with: its name (for temporary folders), its task, its starting model's folder,
# the trainer's settings and the classes of its trainer, its reward function and its recorder. Another
# testbed passes its own to run_one, serve, probe and command.
Testbed = namedtuple("Testbed", "name task model config Run Reward Recorder")
ADDITION = Testbed("addition", TASK, MODEL, CONFIG, Run, Reward, Recorder)


def run_one(tags, start, tokenizer, rows_path, reward="exact", max_batches=max(EVALS), bed=ADDITION):
    """One run of the testbed from a copy of the starting model: (arm, lr, seed) from tags, its rows appended
    to rows_path. The temporary output_dir (the trainer's final save) is deleted."""
    out = tempfile.mkdtemp(prefix=f"{bed.name}-")
    try:
        arm, pairs = tags["arm"], bed.task.split()
        config = long_runs.GRPOConfig(**bed.config, **ARMS[arm], learning_rate=tags["lr"], seed=tags["seed"],
                                      max_steps=steps_at(arm, max_batches), output_dir=out)
        fn = bed.Reward(reward, config)
        trainer = bed.Run(copy_model(start), [fn], args=config, processing_class=tokenizer,
                          train_dataset=dataset(pairs["grpo"], bed.task.prompt, bed.task.answer))
        fn.model, fn.tokenizer = trainer.model, trainer.tokenizer
        trainer.recorder = bed.Recorder({**tags, "attempt": uuid.uuid4().hex[:8]}, fn, pairs["held_out"],
                                        rows_path)
        trainer.train()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def copy_model(model):
    fresh = LlamaForCausalLM(model.config)
    fresh.load_state_dict(model.state_dict())
    return fresh


# ---- The rows: appended by the workers, one lock per line ----------------------------------------------
def read(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def append(path, row):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---- The study: phases, rates, seeds (docs/addition/plan.md) ------------------------------------------
# Every arm's first rates, a factor FACTOR apart; extended by FACTOR beyond an edge (at most MAX_RATES).
GRID, FACTOR, MAX_RATES = (1.25e-5, 2.5e-5, 5e-5, 1e-4), 2.0, 8
# The bridge re-runs tuning seed 1 at the chosen rates with the confirmation's code: the same rows, or the
# difference that a change of code between the phases made.
SEEDS = {"tune": (1, 2, 3), "bridge": (1,), "confirm": tuple(range(101, 121))}
SAME_RATE = {"μ=4 no clip": "μ=4"}  # confirmed at the other arm's chosen rate: the clip's effect alone


def finished_runs(rows):
    """{(phase, arm, lr, seed): its rows} for the runs whose attempt reached its end (the last such)."""
    attempts, runs = {}, {}
    for r in rows:
        attempts.setdefault((r["phase"], r["arm"], r["lr"], r["seed"], r["attempt"]), []).append(r)
    for (phase, arm, lr, seed, _), run in attempts.items():
        if run[-1]["end"]:
            runs[phase, arm, lr, seed] = run
    return runs


def scores(rows, phase):
    """{(arm, budget): {lr: {seed: held-out accuracy at that budget}}} of the phase's finished runs."""
    out = {}
    for (p, arm, lr, seed), run in finished_runs(rows).items():
        for r in run:
            budget = r["completions"] // STEP_SIZE
            if p == phase and budget in BUDGETS:
                out.setdefault((arm, budget), {}).setdefault(lr, {})[seed] = r["accuracy"]
    return out


def means(by_lr, seeds):
    """{lr: mean over the seeds} of the rates that every seed has finished."""
    return {lr: statistics.mean(s[x] for x in seeds) for lr, s in by_lr.items() if set(s) >= set(seeds)}


def tuning_grid(arm, rows):
    """The arm's rates: GRID, and a factor FACTOR beyond an edge wherever a budget's best mean lies on it,
    once every rate so far has every tuning seed."""
    grid, tuning, seeds = set(GRID), scores(rows, "tune"), SEEDS["tune"]
    while len(grid) < MAX_RATES:
        at = {b: means(tuning.get((arm, b), {}), seeds) for b in BUDGETS}
        if not all(set(at[b]) >= grid for b in BUDGETS):
            break
        added = set()
        for b in BUDGETS:
            best = max(grid, key=lambda lr: at[b][lr])
            if best == min(grid):
                added.add(best / FACTOR)
            if best == max(grid):
                added.add(best * FACTOR)
        if not added:
            break
        grid |= added
    return sorted(grid)


def chosen_rates(rows):
    """{(arm, budget): lr} for the arms whose tuning is over (every budget's best strictly inside the grid,
    by the mean over the tuning seeds); SAME_RATE's arms take their partner's."""
    tuning, seeds, chosen = scores(rows, "tune"), SEEDS["tune"], {}
    for arm in ARMS:
        grid, best = tuning_grid(arm, rows), {}
        for b in BUDGETS:
            at = means(tuning.get((arm, b), {}), seeds)
            if set(at) >= set(grid):
                best[b] = max(grid, key=lambda lr: at[lr])
        if len(best) == len(BUDGETS) and all(min(grid) < lr < max(grid) for lr in best.values()):
            chosen.update({(arm, b): lr for b, lr in best.items()})
    for arm, partner in SAME_RATE.items():
        chosen.update({(arm, b): chosen[partner, b] for b in BUDGETS if (partner, b) in chosen})
    return chosen


def tasks(phase, rows):
    """The phase's runs (arm, lr, seed), seed by seed: a phase cut short has every arm at fewer seeds, not
    some at none. Bridge and confirmation: one run per (arm, chosen rate, seed), read at every budget."""
    if phase == "tune":
        grids = {arm: tuning_grid(arm, rows) for arm in ARMS}
        return [(arm, lr, seed) for seed in SEEDS[phase] for arm in ARMS for lr in grids[arm]]
    chosen = chosen_rates(rows)
    order = list(ARMS)
    pairs = sorted({(arm, lr) for (arm, _), lr in chosen.items()}, key=lambda x: (order.index(x[0]), x[1]))
    return [(arm, lr, seed) for seed in SEEDS[phase] for arm, lr in pairs]


def run_length(phase, arm, lr, rows):
    """Mini-batches of 64 a run goes to: a tuning run to the largest budget; a bridge or confirmation run to
    the largest budget that chose its rate (a constant-rate run read at step k is the k-step run, so
    running on would change none of its rows)."""
    if phase == "tune":
        return max(EVALS)
    chosen = chosen_rates(rows)
    return max(b for b in BUDGETS if chosen[arm, b] == lr)


def git(*args):
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


CODE = ["grpo_multistep.py", "grpo_long_runs.py", "experiments/addition.py", "experiments/addition_model"]


def code_version(code=CODE):
    """{"commit": HEAD, "code": a hash of the committed trainer, testbed and starting model}; refused while
    any of them has uncommitted changes: a row must name the code that made it."""
    dirty = git("status", "--porcelain", "--", *code)
    require(not dirty, f"uncommitted changes to the code that runs: commit them first\n{dirty}")
    blobs = git("rev-parse", *[f"HEAD:{p}" for p in code])
    return {"commit": git("rev-parse", "HEAD"), "code": hashlib.sha1(blobs.encode()).hexdigest()[:12]}


def check_confirmation(rows, version):
    """The bridge and the confirmation run after the plan is committed, at one version of the code."""
    plan = "docs/addition/plan.md"
    committed = git("ls-files", plan) and not git("status", "--porcelain", "--", plan)
    require(committed, f"{plan} is not committed: the plan comes first")
    codes = {r["code"] for r in rows if r["phase"] in ("bridge", "confirm")}
    require(codes <= {version["code"]}, f"the confirmation rows so far ran at code {sorted(codes)}, this "
               f"is {version['code']} (commit {version['commit'][:7]}): one phase, one version of the code")


@contextmanager
def locked(path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_next(phases, rows_path, claims_path, planned=None):
    """(phase, arm, lr, seed): the first run of the phases, in order, that no attempt has finished and no
    live worker has claimed, now claimed by this process; None when none is left; "wait" while another
    worker's runs may still add some (a grid extended). `planned(phase, rows)` lists a phase's runs
    (`tasks` unless given: another testbed's plan)."""
    planned = planned or tasks
    with locked(claims_path + ".lock"):
        rows, claims = read(rows_path), read(claims_path)
        done = set(finished_runs(rows))
        busy = {(c["phase"], c["arm"], c["lr"], c["seed"]) for c in claims if alive(c["pid"])} - done
        for phase in phases:
            todo = [(phase, *t) for t in planned(phase, rows) if (phase, *t) not in done | busy]
            if todo:
                _, arm, lr, seed = todo[0]
                append(claims_path, {"phase": phase, "arm": arm, "lr": lr, "seed": seed, "pid": os.getpid()})
                return todo[0]
        if busy:
            return "wait"
        return None


def work(command, worker, folder=ROWS):
    """Run the command's runs until none is left ("confirm": the bridge's, then the confirmation's);
    another worker may share the folder."""
    version = code_version()
    rows_path = os.path.join(folder, "rows.jsonl")
    os.makedirs(folder, exist_ok=True)
    phases = ["tune"]
    if command == "confirm":
        check_confirmation(read(rows_path), version)
        over = {arm for arm, _ in chosen_rates(read(rows_path))}
        require(over == set(ARMS), f"the tuning of {sorted(set(ARMS) - over)} is not over: run tune first")
        phases = ["bridge", "confirm"]
    serve(phases, worker, folder, version)


def serve(phases, worker, folder, version, bed=ADDITION, planned=tasks, length=run_length):
    """Claim the phases' runs of the testbed one at a time and run each, `length(phase, arm, lr, rows)`
    mini-batches long, until none is left."""
    rows_path, claims_path = os.path.join(folder, "rows.jsonl"), os.path.join(folder, "claims.jsonl")
    start, tokenizer = load_start(bed.model)
    while True:
        claimed = claim_next(phases, rows_path, claims_path, planned)
        if claimed is None:
            break
        if claimed == "wait":
            time.sleep(15)
            continue
        phase, arm, lr, seed = claimed
        print(f"worker {worker}: {phase} {arm} lr={lr:g} seed={seed}", flush=True)
        tags = {"phase": phase, "arm": arm, "lr": lr, "seed": seed, **version}
        batches = length(phase, arm, lr, read(rows_path))
        run_one(tags, start, tokenizer, rows_path, max_batches=batches, bed=bed)
    print(f"worker {worker}: no {' or '.join(phases)} run is left", flush=True)


# ---- Commands ---------------------------------------------------------------------------------------------
# The fields that `make` writes into start.json beside the starting model; another testbed records more.
RECORD = ("sampled", "greedy", "sft", "train_seconds", "samples", "held_out_prompts", "eval_seed")


def make(folder=MODEL, task=TASK, record=RECORD):
    """Train the task's starting model, save it with its tokenizer, and beside it the record's fields of its
    held-out scores, its training and its size."""
    began, cpu = time.perf_counter(), time.process_time()
    model, tokenizer = train_start(task.sft["seed"], task.sft["steps"], task)
    seconds, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu
    held_out = task.split()["held_out"]
    scores = held_out_scores(model, tokenizer, held_out, task)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    info = {**scores, "sft": task.sft, "train_seconds": round(seconds, 1),
            "train_cpu_seconds": round(cpu_seconds, 1), "samples": EVAL_SAMPLES,
            "held_out_prompts": len(held_out), "eval_seed": EVAL_SEED,
            "weights": sum(p.numel() for p in model.parameters())}
    info = {key: info[key] for key in record}
    with open(os.path.join(folder, "start.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info


def probe(arm, lr, seed, batches, reward, rows_path, bed=ADDITION):
    """One run, its rows printed at its end (a quick look before a study, or a confirmation cell checked)."""
    start, tokenizer = load_start(bed.model)
    run_one({"phase": "probe", "arm": arm, "lr": lr, "seed": seed}, start, tokenizer, rows_path,
            reward=reward, max_batches=batches, bed=bed)
    for row in read(rows_path):
        print(json.dumps(row, ensure_ascii=False))


def parser(description, arms, lr, batches, rows, rewards):
    """A testbed's command line: its arms, and a probe's rate and mini-batches unless given."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["make", "probe", "tune", "confirm"])
    p.add_argument("--worker", type=int, default=0, help="a name for this worker's lines")
    p.add_argument("--rows", default=rows, help="the folder of rows.jsonl and claims.jsonl")
    p.add_argument("--arm", default="μ=1", choices=list(arms))
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, default=batches)
    p.add_argument("--reward", default="exact", choices=list(rewards))
    return p


def command(opts, bed, make_start, work_phases):
    """Run the command line's command: the testbed's `make_start` or `work_phases`, or a probe of one run."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if opts.command == "make":
        print(json.dumps(make_start(), indent=1))
    elif opts.command in ("tune", "confirm"):
        work_phases(opts.command, opts.worker, opts.rows)
    else:
        folder = tempfile.mkdtemp(prefix=f"{bed.name}-probe-")
        rows_path = os.path.join(folder, "rows.jsonl")
        probe(opts.arm, opts.lr, opts.seed, opts.batches, opts.reward, rows_path, bed)
        shutil.rmtree(folder)


def main(argv=None):
    opts = parser(__doc__, ARMS, 1e-4, max(EVALS), ROWS, REWARDS).parse_args(argv)
    command(opts, ADDITION, make, work)


if __name__ == "__main__":
    main()
