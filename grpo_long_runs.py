"""What long runs need, on top of grpo_multistep.py, which stays the whole algorithm and a trainer that
works alone. Import from here instead of there and nothing else changes:

    from grpo_long_runs import GRPOConfig, GRPOTrainer     # not: from grpo_multistep import ...

This module adds, each by overriding a method of grpo_multistep.GRPOTrainer (no hook of its own):
- a failure (an exception, Ctrl-C, SIGTERM at preemption) keeps the finished steps: the last finished step's
  metrics row and checkpoint are written at once; only a weight update and a row's or checkpoint's write
  hold a signal;
- torchrun: N processes make the same updates as one, and a failure in one process ends them all;
- a faster log-prob pass (the LM head in chunks, a prompt's pass shared by its G completions);
- one history per output_dir: a used one is refused unless overwrite_output_dir or a resume of its own, and
  a resume sets the abandoned timeline's later checkpoints aside;
- inputs checked at construction: the config's types, prompts, reward functions (two of one name get a
  metric each); before a resume loads anything, a checkpoint's files, trained tensors and training prompts
  (a batch it cached with β = 0 gets π_ref's log-probs);
- report_to's trackers, model_init_kwargs, bf16, gradient_checkpointing, log_completions, save_total_limit,
  and with resume_from_checkpoint=True the newest checkpoint that reads whole (a damaged one is skipped);
- the seconds of each phase, logged as time_<phase>.
"""
import asyncio, contextlib, dataclasses, functools, hashlib, importlib, importlib.util, inspect, json, math
import numbers, os, shutil, signal, threading, time, typing, warnings
from collections import defaultdict

import huggingface_hub, safetensors
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import grpo_multistep as core
from grpo_multistep import arg, list_checkpoints, require

TRACKERS = ("tensorboard", "wandb", "trackio")


@dataclasses.dataclass
class GRPOConfig(core.GRPOConfig):
    overwrite_output_dir: bool = arg(False, "Start a fresh run in an output_dir that holds a run's files.")
    report_to: list[str] | str | None = arg("none", "Trackers: 'tensorboard', 'wandb', 'trackio', a list, "
                                                     "'all' or 'none'.")
    model_init_kwargs: dict | str | None = arg(None, "from_pretrained's keyword arguments (JSON too).")
    gradient_checkpointing: bool = arg(False, "Recompute activations in backward: less memory, more time.")
    log_completions: bool = arg(False, "Print a few prompts, completions and rewards at each log.")
    save_total_limit: int | None = arg(None, "Keep at most this many checkpoints (None: all).")
    bf16: bool = arg(False, "bfloat16 autocast for every model call (less memory; not always faster).")

    def __post_init__(self):
        check_types(self)
        super().__post_init__()
        check_report_to(self)


def check_types(config):
    """Each field's value must fit its annotation: "false" is a true string, 1.5 steps no number of steps.
    A Path becomes a string and a numpy number a Python one, so that trainer_state.json can hold them."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kinds = [typing.get_origin(k) or k for k in (typing.get_args(hints[f.name]) or [hints[f.name]])]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int in kinds:
            value = int(value)
        is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if is_real and float in kinds and int not in kinds:
            value = float(value)
        if f.name == "report_to" and value is None:  # As in transformers: None means no tracker.
            value = "none"
        fits = isinstance(value, tuple(kinds)) and (bool in kinds or not isinstance(value, bool))
        require(fits, f"GRPOConfig.{f.name}={value!r} must be of type {hints[f.name]}", TypeError)
        finite = not isinstance(value, float) or math.isfinite(value)
        require(finite, f"GRPOConfig.{f.name}={value!r} must be finite")
        setattr(config, f.name, value)
    require(config.seed < 2**63, f"GRPOConfig.seed={config.seed} must be < 2**63")
    require(config.output_dir != "", "GRPOConfig.output_dir='' names no folder: give one ('.' for this one)")
    require(config.save_total_limit is None or config.save_total_limit >= 1,
            f"GRPOConfig.save_total_limit={config.save_total_limit} must be >= 1")


def check_report_to(config):  # TRL's: a name, a list of names, "all" or "none".
    names = config.report_to
    if isinstance(names, str):
        names = [names]
    installed = [name for name in TRACKERS if importlib.util.find_spec(name) is not None]
    if names == ["all"]:
        names = installed
    if names == ["none"]:
        names = []
    unknown = [name for name in names if name not in TRACKERS]
    require(not unknown, f"GRPOConfig.report_to names {unknown}: each must be one of {TRACKERS}, or give "
            "'all' or 'none'")
    missing = [name for name in names if name not in installed]
    require(not missing, f"GRPOConfig.report_to names {missing}, which are not installed: pip install "
            + " ".join(missing), ImportError)
    config.report_to = names


class GRPOTrainer(core.GRPOTrainer):
    """grpo_multistep.GRPOTrainer with what long runs need; the same arguments."""

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None):
        check_versions()
        args = args if args is not None else GRPOConfig()
        require(isinstance(args, GRPOConfig), "args must be grpo_long_runs.GRPOConfig (it has the fields "
                f"this trainer reads), got {type(args).__module__}.{type(args).__name__}", TypeError)
        reward_funcs = check_reward_funcs(reward_funcs)
        train_dataset = check_prompts(train_dataset, "train_dataset")
        eval_dataset = check_prompts(eval_dataset, "eval_dataset")
        rank, world_size, device = init_distributed()
        if isinstance(model, (str, os.PathLike)):
            model, processing_class = load_model(model, processing_class, args)
        elif args.model_init_kwargs is not None:  # As TRL: they are from_pretrained's, for a model it loads.
            warnings.warn("GRPOConfig.model_init_kwargs are ignored: the model is loaded already (pass its "
                          "hub id or folder for them to apply)", stacklevel=2)
        known = isinstance(model, PreTrainedModel) or core.is_peft(model)
        require(known, "model must be a hub id, a folder, a PreTrainedModel or a peft.PeftModel, got "
                f"{type(model).__name__}", TypeError)
        require(model.get_output_embeddings() is not None, f"{type(model).__name__} has no LM head to "
                "generate with: load the model with AutoModelForCausalLM", TypeError)
        trains = peft_config is not None or any(p.requires_grad for p in model.parameters())
        require(trains or not core.is_peft(model), "the PeftModel has no trainable weights (peft loads an "
                "adapter frozen unless asked): load it with PeftModel.from_pretrained(base, folder, "
                "is_trainable=True)")
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                         peft_config)
        self.rank, self.world_size, self.device = rank, world_size, device
        check_lm_head(self.model, self.tokenizer)
        vocabulary = self.model.get_input_embeddings().weight.size(0)  # (A LoRA one has no num_embeddings.)
        require(len(self.tokenizer) <= vocabulary, f"the tokenizer has {len(self.tokenizer)} tokens, the "
                f"model's embeddings {vocabulary}: after adding tokens, model.resize_token_embeddings")
        check_rewards(self)
        self.seconds = defaultdict(float)  # Per phase, since the last step's end.
        self.holding = False  # True from a weight update to its end_of_step, and in a checkpoint write.
        self.updating = False  # True while AdamW changes the weights: a failure then has no step to save.
        self.optimizer.register_step_pre_hook(self.start_update)
        # AdamW matches its state to the tensors by position: with their names, a resume can check them.
        self.optimizer.param_groups[0]["param_names"] = [n for n, p in self.model.named_parameters()
                                                         if p.requires_grad]
        self.signal = None
        self.trackers = []
        self.samples = []  # The last training batch's (prompt, completion, reward), for log_completions.

    def train(self, resume_from_checkpoint=None):
        """Checks, output_dir and trackers, then grpo_multistep's train(), keeping the finished steps."""
        args = self.args
        check_types(args)  # Fields may have changed since the trainer was made.
        check_report_to(args)
        check_rewards(self)
        if args.eval_strategy == "steps":
            check_eval_split(self)
        self.model.activation_checkpointing_disable()  # As the config says now.
        self.model.eval()  # No dropout: the same weights must give the same log-probs (π_old = π_θ).
        if args.gradient_checkpointing:  # It works in train mode only: dropout is turned off by hand.
            self.model.activation_checkpointing_enable({"use_reentrant": False})
            self.model.train()
            for m in self.model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
                if isinstance(getattr(m, "attention_dropout", None), float):
                    m.attention_dropout = 0.0
        self.dataset_id = prompts_id(self.train_dataset)
        if resume_from_checkpoint is True:  # The newest complete checkpoint in output_dir that reads whole.
            found = list_checkpoints(args.output_dir)
            require(found, f"{args.output_dir!r} holds no checkpoint to resume: start a fresh run")
            resume_from_checkpoint = newest_readable(self, found)
        resumed_step = None
        if resume_from_checkpoint:
            resumed_step = check_checkpoint(self, os.fspath(resume_from_checkpoint))
        if self.rank == 0:
            prepare_output_dir(args, resume_from_checkpoint)
        if self.world_size > 1:
            dist.barrier()  # The other processes write into output_dir only once it is ready.
        self.signal = None
        self.unfinished = None  # A finished step's metrics while its end_of_step runs (keep_finished_steps).
        self.logged_step = None  # The step of the last row that end_of_step logged, once written.
        self.checkpointed = resumed_step  # The step of the last checkpoint this process wrote its part of.
        self.start_time = time.perf_counter()
        with keep_finished_steps(self):
            if self.rank == 0:
                self.trackers = [Tracker(name, args, resumed_step) for name in args.report_to]
            super().train(resume_from_checkpoint)
        return self

    # ---- The phases' seconds: what each override adds to self.seconds -----------------------------------
    def generate_and_score(self, k):
        start = lap(self)
        logps_before = self.seconds["logps"]
        result = super().generate_and_score(k)
        self.seconds["generate"] += lap(self) - start - (self.seconds["logps"] - logps_before)
        return result

    def cached_logps(self, model, batch):
        start = lap(self)
        result = super().cached_logps(model, batch)
        self.seconds["logps"] += lap(self) - start
        return result

    def logps(self, model, mb):  # The faster pass below, timed as "forward" where it trains.
        start = lap(self)
        with autocast(self):
            result = per_token_logps(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                     mb["completion_mask"], self.args.temperature)
        if torch.is_grad_enabled():
            self.seconds["forward"] += lap(self) - start
        return result

    def optimizer_step(self, batch):
        if self.args.beta > 0 and "ref_logps" not in batch:  # Cached with β = 0, then resumed with β > 0.
            with core.reference_weights(self.ref_model):  # π_ref never changes: the log-probs it had then.
                batch["ref_logps"] = self.cached_logps(self.ref_model, batch)
        start = lap(self)
        forward_before = self.seconds["forward"]
        metrics = super().optimizer_step(batch)
        step = lap(self) - start - (self.seconds["forward"] - forward_before)
        self.seconds["backward"] += step - self.seconds["optimizer"]
        return metrics

    def update(self):  # Under torchrun, the gradients are summed first; a signal waits for the step's end.
        start = lap(self)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.world_size > 1 and grads:  # One flat buffer, one collective.
            flat = self.all_reduce(torch.cat([g.flatten() for g in grads]))
            torch.nn.utils.vector_to_parameters(flat, grads)
        grad_norm = super().update()
        self.updating = False
        self.seconds["optimizer"] = lap(self) - start
        return grad_norm

    def start_update(self, *args):  # AdamW's pre-hook: a signal from here waits for the step's end.
        self.updating = True
        self.holding = True

    def sample_and_score(self, dataset, indices):  # An error in one process is raised in all of them.
        error = None
        result = None
        try:
            with autocast(self):  # The generation (and the reward functions) under bf16 autocast.
                result = super().sample_and_score(dataset, indices)
        except Exception as e:
            error = e
        failed = self.all_reduce(torch.tensor(float(error is not None), device=self.device))
        if error is not None:
            raise error
        require(failed == 0, "a reward function or the generation failed in another process (see its log)",
                RuntimeError)
        raise_held_signal(self)  # A reward that swallowed the signal (a bare except) does not score.
        if dataset is self.train_dataset:  # For log_completions.
            self.samples = list(zip(result["prompts"], result["texts"], result["rewards"].tolist()))
        return result

    def all_reduce(self, x):
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def evaluate(self):
        check_eval_split(self)  # Called by a user too, not only by train().
        start = time.perf_counter()
        metrics = super().evaluate()
        metrics["time_eval"] = time.perf_counter() - start
        return metrics

    def end_of_step(self, metrics):
        """The step is finished: its evaluation, log() and trackers are not held against a signal. If a
        failure or a signal cuts them, keep_finished_steps writes the step's row and checkpoint from here."""
        for phase in PHASES:
            metrics[f"time_{phase}"] = self.seconds.pop(phase, 0.0)
        self.unfinished = (metrics, {k: list(v) for k, v in self.window.items()})  # The window before it.
        self.holding = False
        raise_held_signal(self)  # One that came during the update.
        super().end_of_step(metrics)
        self.unfinished = None

    def log(self, row):
        from_user = "step" not in row  # HF's habit, trainer.log({...}) in user code: at the current step.
        row = {"step": self.step, **row, "elapsed": time.perf_counter() - self.start_time}  # Since train().
        with held(self):  # Written and marked as written, or neither: a cut row is written once.
            super().log(row)
            if not from_user:
                self.logged_step = row["step"]
        if self.rank == 0 and self.args.log_completions:
            for prompt, completion, reward in self.samples[:4]:
                if not isinstance(prompt, str):  # A conversation: its last message.
                    prompt = prompt[-1]["content"]
                print(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")
        for tracker in self.trackers:
            tracker.log(row)

    def save_checkpoint(self):  # Under torchrun rank 0 renames it once every process wrote its part.
        with held(self):
            tmp = os.path.join(self.args.output_dir, f"checkpoint-{self.step}.tmp")
            if self.rank == 0:
                done = [os.path.join(tmp, f"rank_{r}.done") for r in range(1, self.world_size)]
                wait_for_files(done)
                for path in done:  # Markers only: the checkpoint holds the rank_<r>.pt files.
                    os.remove(path)
                os.makedirs(tmp, exist_ok=True)
                with open(os.path.join(tmp, "dataset.json"), "w") as f:  # Renamed with the rest, once whole.
                    json.dump(self.dataset_id, f)
            try:
                super().save_checkpoint()
                if self.rank > 0:  # Its rank_<r>.pt is whole: rank 0 may rename the folder.
                    open(os.path.join(tmp, f"rank_{self.rank}.done"), "w").close()
            except (OSError, RuntimeError) as e:  # On a full disk torch.save says only "iostream error".
                raise OSError(f"writing {tmp} failed (a full disk?): {e}") from e
            self.checkpointed = self.step
            limit = self.args.save_total_limit
            if self.rank == 0 and limit is not None:
                for old in list_checkpoints(self.args.output_dir)[:-limit]:
                    shutil.rmtree(old)


PHASES = ("generate", "logps", "forward", "backward", "optimizer")


def check_eval_split(trainer):  # Each process takes an equal share, else their collectives would not match.
    require(trainer.eval_dataset is not None, "an evaluation (eval_strategy='steps' or evaluate()) needs an "
            "eval_dataset")
    n = len(trainer.eval_dataset)
    require(n % trainer.world_size == 0, f"eval_dataset's {n} prompts do not split evenly over "
            f"{trainer.world_size} processes")


def lap(trainer):  # Now, with a GPU's queued work done: time measures the work, not its launch.
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return time.perf_counter()


def autocast(trainer):  # bf16: the model calls run in bfloat16; the loss and AdamW stay in float32.
    return torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=trainer.args.bf16)


# ---- A failure never loses finished steps --------------------------------------------------------------
# On any exception (Ctrl-C included) and at once on SIGTERM (sent at preemption; torchrun passes it to every
# process), the last finished step's row and checkpoint are written, then the exception goes on. Only the
# main thread can catch signals: elsewhere SIGTERM ends the process at once.
@contextlib.contextmanager
def keep_finished_steps(trainer):
    def on_signal(signum, frame):
        trainer.signal = signum
        if not trainer.holding:  # Else what is being written ends first.
            keep_last_step(trainer)  # At once: user code may hold the exception back (a thread pool's join).
            raise exception_for(signum)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, on_signal)
    try:
        yield
    except BaseException:
        keep_last_step(trainer)
        rows = os.path.join(trainer.args.output_dir, "metrics.jsonl")
        if trainer.rank == 0 and os.path.isfile(rows) and os.path.getsize(rows) == 0:
            os.remove(rows)  # A run that failed before its first row leaves no file: it can start again.
        raise
    finally:
        trainer.holding = False
        for s, handler in previous.items():
            signal.signal(s, handler)
        for tracker in trainer.trackers:
            tracker.close()
        trainer.trackers = []


def keep_last_step(trainer):  # Its row and checkpoint, where not written yet.
    before = trainer.holding  # (False after a signal: if user code swallows its exception, it comes again.)
    trainer.holding = True  # A second signal waits for them.
    try:
        if trainer.world_size > 1 and dist.is_initialized():
            # A process waiting in a collective for this one fails now, and writes its part of the checkpoint
            # (rank 0 waits for it): no process waits for code that only another runs (rank 0's log()).
            dist.destroy_process_group()
        if trainer.unfinished is not None:
            log_cut_step(trainer)
        finished = trainer.step > 0 and not trainer.updating  # (A failed update is no finished step.)
        if finished and trainer.checkpointed != trainer.step and trainer.args.save_strategy != "no":
            trainer.save_checkpoint()
    finally:
        trainer.holding = before


def log_cut_step(trainer):
    """A finished step whose end_of_step was cut (its evaluation, log() or a tracker failed, a signal came):
    its metrics join the window and, where the step logs a row that is not written yet, the row goes to
    metrics.jsonl as grpo_multistep's logged_row makes it. Not to the trackers: one may have failed."""
    metrics, window = trainer.unfinished
    trainer.unfinished = None
    if trainer.logged_step == trainer.step:
        return
    trainer.window = defaultdict(list, window)
    for k, v in metrics.items():
        trainer.window[k].append(v)
    if trainer.step % trainer.args.logging_steps == 0 or trainer.step == trainer.args.max_steps:
        row = trainer.logged_row()
        row["elapsed"] = time.perf_counter() - trainer.start_time
        core.GRPOTrainer.log(trainer, row)  # metrics.jsonl and the console, without the trackers


@contextlib.contextmanager
def held(trainer):  # A signal waits for the block's end: a file write that must be whole.
    before = trainer.holding
    trainer.holding = True
    try:
        yield
    finally:
        trainer.holding = before
    raise_held_signal(trainer)


def raise_held_signal(trainer):
    if trainer.signal is not None and not trainer.holding:
        raise exception_for(trainer.signal)


def exception_for(signum):  # Ctrl-C is a KeyboardInterrupt; SIGTERM exits with 128 + 15, as shells say.
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


def wait_for_files(paths, seconds=60):  # The other processes' files, without a collective (none may run).
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    missing = [p for p in paths if not os.path.exists(p)]
    require(not missing, f"{missing} not written in {seconds} s: the checkpoint is unfinished", RuntimeError)


# ---- torchrun: every process runs the program on its own prompts ---------------------------------------
# Each divides its loss by the whole step's normalizers, so the sum of the processes' gradients is the step's.
# (DDP's hooks would miss the LM head, which per_token_logps calls directly.)
def init_distributed():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)  # Before any collective: NCCL uses the current device.
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device


# ---- output_dir: a fresh run never mixes its files with another run's ----------------------------------
def prepare_output_dir(args, resume):
    """One history per folder. A fresh run refuses an output_dir that holds files, unless
    overwrite_output_dir, which deletes the earlier run's checkpoints, metrics, event files and final model
    (no other file). A resume writes into its checkpoint's own folder, or an empty one; that folder's
    checkpoints after it belong to the timeline the resume leaves, and are set aside as
    checkpoint-<n>.abandoned."""
    out = args.output_dir
    os.makedirs(out, exist_ok=True)
    names = sorted(os.listdir(out))
    own = bool(resume) and os.path.samefile(os.path.dirname(os.path.abspath(resume)), out)
    require(not names or own or args.overwrite_output_dir, f"output_dir {out!r} holds "
            f"{', '.join(names[:5])}: choose another output_dir, resume one of its checkpoints "
            "(resume_from_checkpoint=True), or set overwrite_output_dir=True")
    resumed_step = math.inf
    if own and os.path.basename(os.path.abspath(resume)).removeprefix("checkpoint-").isdecimal():
        resumed_step = int(os.path.basename(os.path.abspath(resume)).removeprefix("checkpoint-"))
    for name in names:
        path = os.path.join(out, name)
        number = name.removeprefix("checkpoint-").removesuffix(".tmp")
        checkpoint = name.startswith("checkpoint-") and number.isdecimal() and os.path.isdir(path)
        if checkpoint and (name.endswith(".tmp") or not own):
            shutil.rmtree(path)
        elif checkpoint and int(number) > resumed_step:
            os.replace(path, path + ".abandoned")
            print(f"{path} is of the run before this resume: set aside as {name}.abandoned", flush=True)
        elif name in RUN_FILES and not own:
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)


RUN_FILES = ("metrics.jsonl", "runs", "config.json", "generation_config.json", "model.safetensors",
             "adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "chat_template.jinja")


# ---- report_to: a tracker is imported only where it is named; it gets every row, on rank 0 -------------
class Tracker:
    def __init__(self, name, args, resumed_step=None):
        self.name = name
        self.run = None
        if name == "tensorboard":  # Event files in output_dir/runs/<date-time>, where TRL writes them.
            runs = os.path.join(args.output_dir, "runs")
            self.folder = os.path.join(runs, time.strftime("%Y%m%d-%H%M%S"))
            self.purge_step = None
            if resumed_step is not None and os.path.isdir(runs) and os.listdir(runs):
                # A resume goes on in the run's newest event folder, without the abandoned timeline's later
                # steps: TensorBoard shows each step once.
                self.folder = os.path.join(runs, sorted(os.listdir(runs))[-1])
                self.purge_step = resumed_step + 1
        else:  # wandb and trackio share an API: init(project=, config=) returns a run.
            project = os.environ.get(f"{name.upper()}_PROJECT", "huggingface")  # As transformers does.
            self.run = importlib.import_module(name).init(project=project, config=dataclasses.asdict(args))

    def log(self, row):
        metrics = {k: v for k, v in row.items() if k != "step"}
        if self.name == "tensorboard":
            if self.run is None:  # Made at the first row: a run that logs none leaves no file to refuse.
                tensorboard = importlib.import_module("torch.utils.tensorboard")
                self.run = tensorboard.SummaryWriter(self.folder, purge_step=self.purge_step)
            for k, v in metrics.items():
                self.run.add_scalar(k, v, row["step"])
        else:
            self.run.log(metrics, step=row["step"])

    def close(self):
        if self.name != "tensorboard":
            self.run.finish()
        elif self.run is not None:
            self.run.close()


# ---- Inputs beyond grpo_multistep's own checks ---------------------------------------------------------
def load_model(name, tokenizer, args):  # from_pretrained with model_init_kwargs; code runs only if asked.
    path = os.fspath(name)
    local = not isinstance(name, str) or os.path.exists(path) or not is_hub_id(path)
    kind = "does not exist"  # Else transformers would call it a malformed hub id.
    if os.path.isfile(path):
        kind = "is a file: give the folder that the model was saved to"
    require(not local or os.path.isdir(path), f"model {path!r} is a local path, not a hub id, and no folder: "
            f"{os.path.abspath(path)} {kind}")
    kwargs = args.model_init_kwargs or {}
    if isinstance(kwargs, str):  # JSON, from a command line.
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"GRPOConfig.model_init_kwargs is not JSON: {e}: {kwargs!r}") from None
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs:  # TRL's older name of the same argument.
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs.setdefault("dtype", torch.float32)
    trust = kwargs.setdefault("trust_remote_code", False)
    require(isinstance(trust, bool), f"model_init_kwargs' trust_remote_code={trust!r} must be True or False "
            "(a string such as 'false' would be true)", TypeError)
    if tokenizer is None:  # The model's own tokenizer, trusted as far as the model is.
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs), tokenizer


def is_hub_id(name):  # "org/name": what from_pretrained looks up on the hub when no such folder exists.
    try:
        huggingface_hub.utils.validate_repo_id(name)
    except huggingface_hub.utils.HFValidationError:
        return False
    return True


def check_checkpoint(trainer, path):
    """Before anything loads: every file a resume reads is there, the weights have this model's names and
    shapes (read from the safetensors header alone: load_state_dict would copy those that fit, then raise),
    and AdamW's state is that of the tensors this model trains. Returns the checkpoint's step."""
    require(not path.rstrip(os.sep).endswith(".tmp"), f"{path!r} is an unfinished checkpoint (one is renamed "
            "only once whole): resume from a complete one")
    weights_file = "model.safetensors"
    ours = trainer.model.state_dict()
    if core.is_peft(trainer.model):
        weights_file = "adapter_model.safetensors"
        ours = importlib.import_module("peft").get_peft_model_state_dict(trainer.model)
    ranks = [f"rank_{r}.pt" for r in range(trainer.world_size)]  # Each process decides alike.
    files = ["trainer_state.json", "optimizer.pt", "metrics.jsonl", weights_file, *ranks]
    missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
    require(not missing, f"{path!r} is no checkpoint of this kind of run (LoRA or not): it lacks {missing}")
    headers = functools.partial(torch.load, mmap=True, weights_only=True)  # mmap: shapes, not the tensors.
    for name in ranks:
        read(path, name, headers)
    state = read(path, "trainer_state.json", json_file)
    if os.path.isfile(os.path.join(path, "dataset.json")):  # (grpo_multistep's checkpoints have none.)
        then = read(path, "dataset.json", json_file)
        require(then == trainer.dataset_id, f"{path!r} was written with other training prompts (count and "
                f"SHA-256 then, now: {then}, {trainer.dataset_id}): it would continue another prompt order")
    shapes = read(path, weights_file, tensor_shapes)
    wrong = [k for k in shapes if k not in ours or list(ours[k].shape) != shapes[k]]
    require(not wrong, f"{weights_file} in {path!r} is another model's: {sorted(wrong)[:3]} differ in name "
            "or shape")
    # AdamW's state is matched by position: with other trained tensors it would update the wrong ones, or
    # read past a tensor's end.
    optimizer = read(path, "optimizer.pt", headers)
    trained = trainer.optimizer.param_groups[0]
    then = [name for group in optimizer["param_groups"] for name in group.get("param_names", [])]
    other = []
    if then:
        other = sorted(set(then) ^ set(trained["param_names"]))  # Trained in one run only.
    for i, moments in optimizer["state"].items():  # By shape too: grpo_multistep's checkpoints have no names.
        if i >= len(trained["params"]) or moments["exp_avg"].shape != trained["params"][i].shape:
            other.append(f"tensor {i}")
    sizes = [len(group["params"]) for group in optimizer["param_groups"]]
    now = len(trained["params"])
    require(not other and sizes == [now], f"optimizer.pt in {path!r} trains other tensors: {other[:3]} "
            f"(groups of {sizes} tensors; this model trains {now}): "
            "resume with the tensors frozen as they were")
    return state["step"]


class DamagedCheckpoint(ValueError):  # A file that does not read: resume=True takes the checkpoint before.
    pass


def read(path, name, reader):  # A file cut short (a full disk) or damaged is named before anything loads.
    try:
        return reader(os.path.join(path, name))
    except Exception as e:
        raise DamagedCheckpoint(f"{name} in {path!r} is damaged: {type(e).__name__}: {e}") from e


def json_file(file):
    with open(file) as f:
        return json.load(f)


def tensor_shapes(file):  # From the safetensors header alone.
    with safetensors.safe_open(file, "pt") as f:
        return {k: f.get_slice(k).get_shape() for k in f.keys()}


def prompts_id(dataset):  # The training prompts' count and SHA-256: a resume checks that they are the same.
    return [len(dataset), hashlib.sha256(json.dumps(list(dataset["prompt"])).encode()).hexdigest()]


def newest_readable(trainer, checkpoints):  # Oldest first; the oldest is left for train() to check.
    for path in reversed(checkpoints[1:]):
        try:
            check_checkpoint(trainer, path)
            return path
        except DamagedCheckpoint as e:
            print(f"{e}: resuming from the checkpoint before it", flush=True)
    return checkpoints[0]


def check_reward_funcs(reward_funcs):
    """Functions, as TRL calls them, each checked(). A reward model (TRL also takes a sequence classifier or
    its hub id) is refused by name: wrap it in a function that scores the texts."""
    funcs = reward_funcs
    if not isinstance(funcs, (list, tuple)):
        funcs = [funcs]
    models = [f for f in funcs if isinstance(f, (str, torch.nn.Module))]
    names = [f if isinstance(f, str) else type(f).__name__ for f in models]  # A model's repr is its layers.
    require(not models, f"reward models {names} are not supported: pass a function that calls one", TypeError)
    require(len(funcs) > 0 and all(callable(f) for f in funcs), "reward_funcs must be a function or a "
            f"non-empty list of functions, got {reward_funcs!r}", TypeError)
    funcs = [checked(f) for f in funcs]
    names = [f.__name__ for f in funcs]
    for i, f in enumerate(funcs):  # Two functions of one name (two lambdas) keep a metric each.
        if names.count(names[i]) > 1:
            f.__name__ = f"{names[i]}_{names[:i].count(names[i]) + 1}"
    return funcs


def checked(function):
    """The reward function, awaited if async (as TRL does), its values refused where they come in no order of
    the completions: a dict or a set would give its keys, a string its characters."""
    name = getattr(function, "__name__", type(function).__name__)  # A callable object's class.

    @functools.wraps(function)
    def call(**kwargs):
        try:
            values = function(**kwargs)
            if inspect.iscoroutine(values):
                values = asyncio.run(values)
            kind = type(values).__name__
            require(not isinstance(values, (dict, set, str)), f"it returned a {kind}: return a list of one "
                    "number (or None) per completion, in their order", TypeError)
            return [math.nan if v is None else float(v) for v in values]
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} failed: {type(e).__name__}: {e}") from e
    call.__name__ = name
    return call


def check_prompts(dataset, name):
    """Each prompt a non-empty string, or a list of {"role", "content"} messages, one kind per dataset; no
    column named as an argument the reward functions already receive. Named with its row, at construction.
    Returns the prompts as a datasets.Dataset (a list of rows becomes one)."""
    if dataset is None:
        return None
    require(isinstance(dataset, (Dataset, list)), f"{name} must be a datasets.Dataset (prompts are drawn by "
            f"index) or a list of rows, got {type(dataset).__name__}", TypeError)
    rows = dataset
    if isinstance(dataset, Dataset):
        rows = dataset.to_list()
    kinds = set()
    for i, row in enumerate(rows):
        taken = sorted({"prompts", "completions", "completion_ids"} & set(row))
        require(not taken, f"{name}'s columns {taken} take names that the reward functions receive already")
        prompt = row.get("prompt")
        text = isinstance(prompt, str) and prompt.strip() != ""
        chat = isinstance(prompt, list) and len(prompt) > 0 and all(is_message(m) for m in prompt)
        require(text or chat, f"{name} row {i}: its prompt {prompt!r:.80} must be a non-empty string or a "
                "list of {'role', 'content'} messages with string values")
        kinds.add(text)
    require(len(kinds) <= 1, f"{name} mixes text prompts and conversations: give it one kind")
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    return dataset


def is_message(m):
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def check_rewards(trainer):  # Weights: finite, one per function; checked again at train().
    weights = trainer.args.reward_weights
    if weights is None:
        return
    n = len(trainer.reward_funcs)
    require(len(weights) == n, f"GRPOConfig.reward_weights has {len(weights)} weights for {n} reward "
            "functions")
    require(all(math.isfinite(w) for w in weights), f"GRPOConfig.reward_weights={weights} must be finite")


def check_lm_head(model, tokenizer):  # The faster pass computes the logits as lm_head(hidden states).
    with torch.no_grad():
        ids = torch.tensor([[tokenizer.eos_token_id] * 3], device=model.device)
        head = model.get_output_embeddings()
        logits = model(input_ids=ids).logits[:, -3:]
        head_logits = head(model.get_decoder()(input_ids=ids).last_hidden_state)
        same = isinstance(head, torch.nn.Linear) and torch.allclose(logits, head_logits, rtol=1e-3, atol=1e-3)
    require(same, f"{type(model).__name__}'s logits are not lm_head(hidden states) (softcapping, scaling, an "
            "adapter on lm_head?): the faster log-prob pass would be wrong; use grpo_multistep's trainer")


def check_versions():  # The requirements' lower bounds: older versions fail deep inside, unnamed.
    from packaging.version import Version
    for module, need in ((torch, "2.4"), (importlib.import_module("transformers"), "5.24")):
        found = module.__version__.split("+")[0]
        require(Version(found) >= Version(need), f"GRPOTrainer needs {module.__name__} >= {need}, found "
                f"{found}: pip install '{module.__name__}>={need}'", ImportError)


# ---- The faster log-prob pass ---------------------------------------------------------------------------
# grpo_multistep.per_token_logps made fast (a test holds them equal). A prompt's G completions share one
# pass over it, and the LM head runs CHUNK tokens at a time: no (b, C, V) logits at once. It also
# returns each token's entropy H(π(· | q, o_<t)), from the same logits, for a metric. (b, C) each.
def per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    mask = torch.cat([prompt_mask, completion_mask], 1)                                    # (b, P+C)
    decoder = model.get_decoder()
    P = prompt_ids.size(1)
    positions = core.position_ids(mask)                                                         # (b, P+C)
    if model.is_activation_checkpointing:  # Recomputed layers cannot share a prompt's cache: one pass.
        hidden = decoder(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                         position_ids=positions).last_hidden_state[:, P - 1:-1]            # (b, C, H)
    else:  # B·P + B·G·C tokens, not B·G·(P + C): G completions attend to one pass over their prompt.
        first = torch.ones(len(prompt_ids), dtype=torch.bool, device=mask.device)  # A prompt's first row.
        first[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1)
        prompt_of = first.cumsum(0) - 1                                                    # (b,)
        prompt = decoder(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                         position_ids=positions[first, :P], use_cache=True)
        prompt.cache.batch_select_indices(prompt_of)  # Each row gets its prompt's keys and values.
        completion = decoder(input_ids=completion_ids, attention_mask=mask, position_ids=positions[:, P:],
                             cache=prompt.cache, use_cache=True).last_hidden_state        # (b, C, H)
        # The prompt's last state predicts completion token 0; completion token t's state predicts t + 1.
        hidden = torch.cat([prompt.last_hidden_state[prompt_of, -1:], completion[:, :-1]], 1)  # (b, C, H)
    head = model.get_output_embeddings()  # logits = lm_head(hidden), as check_lm_head checks.
    pairs = zip(hidden.flatten(0, 1).split(CHUNK), completion_ids.flatten().split(CHUNK))
    results = [TokenLogps.apply(h, y, temperature, head.weight, head.bias) for h, y in pairs]
    logps = torch.cat([r[0] for r in results]).view_as(completion_ids)
    entropies = torch.cat([r[1] for r in results]).view_as(completion_ids)
    return logps, entropies

CHUNK = 256  # Tokens per LM-head chunk: 256 × 49,152 logits are 50 MB for SmolLM2.

# The LM head for CHUNK tokens: log π(y) = z_y - logsumexp(z), z = (h Wᵀ + b) / T. Forward keeps only h and
# logsumexp(z); backward computes z again, in place, into the gradient onehot(y) - softmax(z). Against
# activation checkpointing of the head this saves 0.27 GiB and 5 % of the time (SmolLM2, the CPU demo).
class TokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, temperature, weight, bias):                 # (n, H), (n,)
        logits = F.linear(hidden, weight, bias).float().div_(temperature)                  # (n, V): z
        lse = logits.logsumexp(-1)                                                         # (n,)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.temperature = temperature
        ctx.bf16 = torch.is_autocast_enabled(hidden.device.type)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse                       # (n,)
        log_probs = logits.sub_(lse[:, None])                           # (n, V): log π(v), in z's memory
        entropy = -log_probs.exp().mul_(log_probs).sum(-1)              # (n,): -Σ_v π(v) log π(v)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _):                                          # grad (n,): d loss / d log π(y)
        hidden, targets, weight, bias, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, torch.bfloat16, enabled=ctx.bf16):  # As in forward.
            logits = F.linear(hidden, weight, bias).float()                                # (n, V)
        grad_z = logits.div_(ctx.temperature).sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax·grad
        grad_z.scatter_add_(1, targets[:, None], grad[:, None])                            # + onehot(y)·grad
        grad_logits = grad_z.div_(ctx.temperature).to(weight.dtype)                        # dz/dlogits = 1/T
        grad_weight = None
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_weight = grad_logits.T @ hidden.to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[4]:
            grad_bias = grad_logits.sum(0)
        return (grad_logits @ weight).to(hidden.dtype), None, None, grad_weight, grad_bias
