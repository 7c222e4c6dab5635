"""run.sh's last step: the decode loop's milliseconds per step against the batch size (one optimizer step's
completions of experiments/benchmark.py's shape, and 2, 4 and 8 times as many: S = 4's generation batch is
the 4× one), set beside the bound of reading the weights once per step. On a GPU, where a decode step is
launch-bound, a larger batch costs little more per step: what makes steps_per_generation cheap there.
Writes decode.json and decode.md into the output folder.

    python docs/gpu-sweep/decode.py OUTPUT_FOLDER TRAIN_TLDR_FLAGS...

MEMORY_BANDWIDTH (bytes/s) overrides the table below; GIT_COMMIT names the code (run.sh sets it)."""
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
import types

import torch
import transformers

import grpo_multistep as gm
import train_tldr
from experiments.benchmark import BENCHMARK, as_flags

STEPS = 64   # decode steps timed: as many as TRL PR #2899's completions have tokens
MULTIPLES = (1, 2, 4, 8)  # batch sizes, in optimizer steps' completions
REPEATS = 3  # timings of each length after a warm-up; their median
# Peak memory bandwidth in bytes/s, by a part of torch.cuda.get_device_name(), from NVIDIA's datasheets:
# H200 (SXM) 4.8 TB/s of HBM3e, H100 SXM 3.35 TB/s of HBM3. The device tool's notes saw a device-to-device
# copy move about 4.3 TB/s on its H200: about 90 % of the datasheet's figure is reachable.
BANDWIDTH = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12}


def bandwidth(device_name):
    """(bytes/s or None, where the number comes from)."""
    if os.environ.get("MEMORY_BANDWIDTH"):
        return float(os.environ["MEMORY_BANDWIDTH"]), "MEMORY_BANDWIDTH, set by the caller"
    for key, value in BANDWIDTH.items():
        if key in device_name:
            return value, f"NVIDIA's datasheet for the {key} (decode.py's table)"
    return None, "unknown: no entry for this device in decode.py's table (set MEMORY_BANDWIDTH in bytes/s)"


def seconds(fn, device):
    if device.type == "cuda":  # the GPU runs behind Python: wait for it on both sides of the clock
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def decode_step_ms(model, tokenizer, config, prompts, device):
    """Milliseconds per step of generate_completions' token-by-token loop: one sampled token and one
    cached forward for each of the batch's sequences. A call of n steps costs the prompt's prefill plus n
    steps, so (t(1 + STEPS) - t(1)) / STEPS leaves the prefill out."""
    ids, mask = gm.tokenize_prompts(tokenizer, prompts, config.max_prompt_length)
    ids, mask = ids.to(device), mask.to(device)
    # No sampled token has id -1, so no sequence ends early: every call runs all the steps it is given.
    no_eos = types.SimpleNamespace(eos_token_id=-1, pad_token_id=tokenizer.pad_token_id)

    def time_steps(n):
        args = dataclasses.replace(config, max_completion_length=n)
        return seconds(lambda: gm.generate_completions(model, no_eos, ids, mask, args), device)

    for n in (1, 1 + STEPS):  # warm-up: CUDA context, kernels, allocator
        time_steps(n)
    short = statistics.median(time_steps(1) for _ in range(REPEATS))
    long = statistics.median(time_steps(1 + STEPS) for _ in range(REPEATS))
    return 1000 * (long - short) / STEPS, len(ids) * config.num_generations, ids.size(1)


def main(out, flags):
    config, opts = train_tldr.parse_args([*as_flags(BENCHMARK), *flags])  # the benchmark's shape, then flags
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    torch.manual_seed(config.seed)
    # The model and tokenizer as the trainer prepares them (pad token, no dropout), on the same device.
    model, tokenizer = gm.load_policy(train_tldr.resolve_model(opts.model), None, None, config, device)
    prompts = train_tldr.load_prompts(opts.dataset)["prompt"][:]
    step = config.per_device_train_batch_size * config.gradient_accumulation_steps // config.num_generations
    by_batch = []
    for k in MULTIPLES:  # k optimizer steps' prompts (the same again where the dataset has fewer)
        batch = [prompts[i % len(prompts)] for i in range(k * step)]
        ms, sequences, prompt_tokens = decode_step_ms(model, tokenizer, config, batch, device)
        by_batch.append({"steps_worth": k, "sequences": sequences, "ms_per_decode_step": ms,
                         "times_one_step_s": ms / (by_batch[0]["ms_per_decode_step"] if by_batch else ms)})
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    bytes_per_s, source = bandwidth(name)
    bound_ms = 1000 * model_bytes / bytes_per_s if bytes_per_s else None
    result = {
        "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("GIT_COMMIT", "unknown"), "model": opts.model, "decode_steps": STEPS,
        "prompt_tokens": prompt_tokens, "by_batch": by_batch, "model_bytes": model_bytes,
        "dtype": str(next(model.parameters()).dtype), "bandwidth_bytes_per_s": bytes_per_s,
        "bandwidth_source": source, "weights_read_bound_ms": bound_ms,
    }
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    bound = (f"{bound_ms:.3g} ms ({model_bytes / 1e6:.4g} MB of {result['dtype']} weights at "
             f"{bytes_per_s / 1e12:.3g} TB/s, {source})" if bound_ms else source)
    times_bound = lambda r: f"{r['ms_per_decode_step'] / bound_ms:.3g}" if bound_ms else "—"
    rows = "".join(f"| {r['steps_worth']} | {r['sequences']} | {r['ms_per_decode_step']:.3g} | "
                   f"{r['times_one_step_s']:.2f} | {times_bound(r)} |\n" for r in by_batch)
    text = (f"# Decode time against the batch size, {name}\n\n"
            f"{result['date']}, commit {result['commit']}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, model {opts.model}; one token for each sequence after "
            f"{prompt_tokens} prompt tokens, sampling included; {STEPS} steps, median of {REPEATS}, prefill "
            "left out.\n\n"
            "| optimizer steps' completions | sequences | ms per decode step | × one step's | × the bound |\n"
            f"|---|---|---|---|---|\n{rows}\nBound of reading the weights once per step: {bound}.\n")
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
