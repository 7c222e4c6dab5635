"""Peak memory of GRPO optimizer steps (RSS; on a GPU also torch.cuda.max_memory_allocated), beside
tldr/memory.py's estimate; or, with --fit, what train_tldr.py would run on a GPU with that much free memory.

    nice -n 10 python -m experiments.measure_memory MODEL SHAPES [--steps N] [--gradient_checkpointing]
                                                   [--bf16]
    python -m experiments.measure_memory MODEL SHAPES --fit [FREE_GIB ...]

MODEL: qwen2.5-0.5b (Qwen2.5-0.5B's published config) or smollm2-135m (the config of the converted
SmolLM2-135M-Instruct, tldr/offline.py's, in ~/.cache/grpo_multistep or $GRPO_MULTISTEP_CACHE); SHAPES: a
train_tldr.py preset's shapes, pr2899 or cpu. --bf16: under bf16 autocast (float32 weights), as the demo runs
on a GPU that computes bf16 natively. --fit without figures: this GPU's free memory, in bf16 where native.
Each measurement is a fresh process (`measure`): it imports, builds a word-level tokenizer and the prompts,
reads its RSS (the baseline: everything but the model), builds the model from the config with random
weights (nothing is downloaded), trains N optimizer steps (save_steps large: the final save only, into a
temporary output_dir) and reports its peak RSS (VmHWM) and, from a thread that reads /proc/self/statm
every 2 ms, the highest RSS of each phase and (glibc) of the bytes that malloc has handed out and not had
back ("live": mallinfo2's in-use heap plus mmapped blocks; RSS minus live is what the allocator keeps).
Random weights rarely sample EOS: completions run to max_completion_length, the worst case; prompts are
longer than max_prompt_length, so they are cut to it.
"""
import contextlib, functools, json, os, random, subprocess, sys, tempfile, threading, time

from tldr import memory as tldr_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's: -m finds the package
SHAPES = ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps",
          "max_prompt_length", "max_completion_length", "beta", "temperature", "loss_type", "learning_rate")
GIB = 2**30


def model_config(name):  # a dict that transformers.AutoConfig.for_model takes
    if name == "qwen2.5-0.5b":
        return dict(tldr_memory.QWEN25_05B)
    from tldr import offline as tldr_offline
    with open(os.path.join(tldr_offline.smollm2_folder(), "config.json")) as f:  # converted once, if need be
        config = json.load(f)
    keep = ("model_type hidden_size intermediate_size num_hidden_layers num_attention_heads "
            "num_key_value_heads head_dim vocab_size tie_word_embeddings max_position_embeddings "
            "rope_parameters rms_norm_eps attention_bias mlp_bias hidden_act").split()
    return {k: config[k] for k in keep if k in config}


def shapes(preset, **overrides):  # the preset's GRPOConfig shape fields (train_tldr.py's PRESETS)
    import train_tldr
    return {**{k: v for k, v in train_tldr.PRESETS[preset].items() if k in SHAPES}, **overrides}


def measure(config, args, steps=1, timeout=3600, env=None):
    """Run `steps` optimizer steps in a fresh process (env: more environment variables): {baseline, peak,
    phases, live (bytes), params, seconds}."""
    spec = json.dumps({"config": config, "args": args, "steps": steps})
    out = subprocess.run([sys.executable, "-m", "experiments.measure_memory", "--child", spec], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    if out.returncode:
        raise RuntimeError(f"measurement failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mallinfo():  # glibc's mallinfo2 (2.33+), or None
    import ctypes
    with contextlib.suppress(OSError, AttributeError):
        class Mallinfo2(ctypes.Structure):
            names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
            _fields_ = [(n, ctypes.c_size_t) for n in names.split()]
        f = ctypes.CDLL("libc.so.6").mallinfo2
        f.restype = Mallinfo2
        return f
    return None


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_phase(phase, owner, name, label, on_end=None):
    """Wrap owner.name so that its calls set phase[0] to `label` (a call inside another phase keeps that one)
    for a sampling thread to read; on_end(label) runs as such a call ends (experiments/memory_phases.py passes
    its record_heap_free)."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        outer = phase[0]
        phase[0] = label if outer == "between" else outer
        try:
            return f(*args, **kwargs)
        finally:
            time.sleep(0.005)  # let the sampler see the phase's end
            if on_end is not None and phase[0] == label:
                on_end(label)
            phase[0] = outer
    setattr(owner, name, wrapped)


def child(spec):
    import warnings
    import torch, transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    import grpo_long_runs as gm
    warnings.filterwarnings("ignore")  # prompts longer than max_prompt_length: on purpose
    config = transformers.AutoConfig.for_model(**spec["config"])
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]  # its module imported now
    words = min(config.vocab_size, 4096)  # ids < the vocabulary; ids beyond the tokenizer's decode to nothing
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, words)}}
    bpe = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>",
                                                     pad_token="<pad>")
    rng = random.Random(0)
    P = spec["args"]["max_prompt_length"]
    prompts = [{"prompt": " ".join(f"w{rng.randrange(2, words)}" for _ in range(P + 16))} for _ in range(64)]
    phase, peak, live, in_use = ["build"], {}, {}, mallinfo()

    def sample():
        while True:
            label = phase[0]
            peak[label] = max(peak.get(label, 0), rss())
            if in_use:
                m = in_use()
                live[label] = max(live.get(label, 0), m.uordblks + m.hblkhd)
            time.sleep(0.002)

    for owner, name, label in [(gm.core, "generate_completions", "generate"),
                               (gm.GRPOTrainer, "cached_logps", "logps"),
                               (gm, "per_token_logps", "forward"), (torch.Tensor, "backward", "backward"),
                               (torch.optim.AdamW, "step", "optimizer"),
                               (gm.core.GRPOTrainer, "save_checkpoint", "save")]:
        in_phase(phase, owner, name, label)
    baseline, m = rss(), in_use and in_use()
    baseline_live = m and m.uordblks + m.hblkhd
    threading.Thread(target=sample, daemon=True).start()
    start = time.perf_counter()
    torch.manual_seed(0)
    model = model_class(config).float()
    params = sum(p.numel() for p in model.parameters())
    phase[0] = "init"
    with tempfile.TemporaryDirectory() as out:
        reward = lambda completions, **kwargs: [-abs(100 - len(c)) for c in completions]  # noqa: E731
        args = gm.GRPOConfig(output_dir=out, max_steps=spec["steps"], save_strategy="no", logging_steps=1,
                             **spec["args"])
        trainer = gm.GRPOTrainer(model, reward, args=args, train_dataset=prompts, processing_class=tokenizer)
        phase[0] = "between"
        trainer.train()
    time.sleep(0.01)
    # VmHWM, this address space's peak: ru_maxrss survives exec, so a child would report its parent's RSS
    # at the fork where that was higher (a test process that had converted SmolLM2: 1.3 GiB)
    with open("/proc/self/status") as f:
        peak_rss = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024  # kB
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None  # (the trainer's device)
    print(json.dumps({"baseline": baseline, "peak": peak_rss, "phases": peak, "live": live, "cuda_peak": cuda,
                      "baseline_live": baseline_live, "params": params,
                      "seconds": time.perf_counter() - start, "torch": torch.__version__}))


def fit(config, args, figures):
    """What train_tldr.py would run on a GPU with each of these free GiB (none: this GPU's free memory, in
    bf16 where the GPU computes it natively), as it prints it."""
    import torch
    here = [None] if torch.cuda.is_available() else []  # None: this GPU
    if not figures and not here:
        print("no GPU here: give free memory figures in GiB")
    for gib in figures or here:
        print("this GPU:" if gib is None else f"{gib} GiB free:")
        try:
            if gib is None:
                tldr_memory.on_cuda(args, None, config)
            else:
                tldr_memory.fit_gpu(args, None, config, free=float(gib) * tldr_memory.GIB)
        except SystemExit as e:
            print(e)


def main(argv):
    import argparse
    import transformers
    import grpo_long_runs as gm
    from tldr.memory import estimate_step_memory
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=["qwen2.5-0.5b", "smollm2-135m"])
    parser.add_argument("shapes", choices=["pr2899", "cpu"])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast over float32 weights")
    parser.add_argument("--fit", type=float, nargs="*", metavar="FREE_GIB", help="print what train_tldr.py "
                        "would run with this much free GPU memory (none given: this GPU's), measure nothing")
    parser.add_argument("--mmap-threshold", type=int, metavar="BYTES", help="glibc's MALLOC_MMAP_THRESHOLD_: "
                        "fixed, so that freed blocks above it go back to the system (default: glibc's own)")
    opts = parser.parse_args(argv)
    config = model_config(opts.model)
    args = shapes(opts.shapes, gradient_checkpointing=opts.gradient_checkpointing, bf16=opts.bf16)
    if opts.fit is not None:
        return fit(transformers.AutoConfig.for_model(**config), gm.GRPOConfig(**args), opts.fit)
    env = {"MALLOC_MMAP_THRESHOLD_": str(opts.mmap_threshold)} if opts.mmap_threshold else {}
    result = measure(config, args, opts.steps, env=env)
    model_config_, grpo_config = transformers.AutoConfig.for_model(**config), gm.GRPOConfig(**args)
    estimate, live = (estimate_step_memory(model_config_, grpo_config, baseline=result["baseline"],
                                           first_step=opts.steps == 1, device=device)
                      for device in ("cpu", "none"))  # "none": without the CPU allocator's retention
    precision = "bf16 autocast" if opts.bf16 else "float32"
    print(f"{opts.model}, {opts.shapes} shapes, {precision}, {opts.steps} step(s), torch {result['torch']}, "
          f"{os.cpu_count()} cores, {result['seconds']:.0f} s; {result['params']:,} parameters")
    print("measured peak RSS by phase (GiB): " + ", ".join(f"{k} {v / GIB:.2f}"
                                                           for k, v in result["phases"].items()))
    if result["live"]:
        print("measured peak live malloc bytes by phase (GiB): " + ", ".join(
            f"{k} {v / GIB:.2f}" for k, v in result["live"].items())
            + f" (baseline {result['baseline_live'] / GIB:.2f})")
    print("estimate's terms (GiB): " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in estimate.items()))
    error = estimate["peak"] / result["peak"] - 1
    print(f"measured peak RSS {result['peak'] / GIB:.2f} GiB (baseline {result['baseline'] / GIB:.2f}); "
          f"estimate {estimate['peak'] / GIB:.2f} GiB: {error:+.1%}; without the retention term "
          f"{live['peak'] / GIB:.2f} GiB: {live['peak'] / result['peak'] - 1:+.1%}")
    if result.get("cuda_peak") is not None:  # on a GPU: what torch allocated there, beside the CUDA estimate
        on_cuda = estimate_step_memory(model_config_, grpo_config, first_step=opts.steps == 1, device="cuda")
        estimate = on_cuda  # (RSS then holds the host's copies, not the step's tensors)
        print(f"measured torch.cuda.max_memory_allocated {result['cuda_peak'] / GIB:.2f} GiB; estimate "
              f"{on_cuda['peak'] / GIB:.2f} GiB (no context, no allocator slack): "
              f"{on_cuda['peak'] / result['cuda_peak'] - 1:+.1%}")
    print(json.dumps({"measured": result, "estimate": estimate}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(json.loads(sys.argv[2]))
    else:
        main(sys.argv[1:])
