"""run.sh's last step: the decode speed of the sweep's model on the sweep's batch shape, set beside the
bound of reading the weights once per token, and the generation share g of the μ = 1 runs. Writes
decode.json and decode.md into the output folder, which already holds the sweep's sweep.jsonl.

    python docs/gpu-sweep/decode.py OUTPUT_FOLDER TRAIN_TLDR_FLAGS...

The flags are the sweep's own, so that the model, the prompts and the batch shape are those it trained on.
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

STEPS = 64   # decode steps timed: as many as TRL PR #2899's completions have tokens
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


def cost_shares(sweep_file):
    """(g, l) of the μ = 1 runs, computed by the sweep's own report code from its sweep.jsonl."""
    runs = {}
    with open(sweep_file) as f:
        for point in map(json.loads, f):
            if point["mu"] == 1:
                runs.setdefault((point["seed"], point.get("lr")), []).append(point)
    return train_tldr.cost_shares([{"points": points} for points in runs.values()])


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
    config, opts = train_tldr.parse_args(flags)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})"
    torch.manual_seed(config.seed)
    # The model and tokenizer as the trainer prepares them (pad token, no dropout), on the same device.
    model, tokenizer = gm.load_policy(train_tldr.resolve_model(opts.model), None, config, device)
    batch = config.per_device_train_batch_size * config.gradient_accumulation_steps  # an optimizer step's
    prompts = train_tldr.load_prompts(opts.dataset)[:batch // config.num_generations]["prompt"]
    ms, sequences, prompt_tokens = decode_step_ms(model, tokenizer, config, prompts, device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights once
    bytes_per_s, source = bandwidth(name)
    bound_ms = 1000 * model_bytes / bytes_per_s if bytes_per_s else None
    g, l = cost_shares(os.path.join(out, "sweep.jsonl"))
    result = {
        "device": name, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("GIT_COMMIT", "unknown"), "model": opts.model,
        "generation_share_g": g, "forward_share_l": l,
        "decode_steps": STEPS, "sequences": sequences, "prompt_tokens": prompt_tokens,
        "ms_per_decode_step": ms, "model_bytes": model_bytes, "dtype": str(next(model.parameters()).dtype),
        "bandwidth_bytes_per_s": bytes_per_s, "bandwidth_source": source,
        "weights_read_bound_ms": bound_ms, "times_the_bound": ms / bound_ms if bound_ms else None,
    }
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    bound = (f"{bound_ms:.3g} ms ({model_bytes / 1e6:.4g} MB of {result['dtype']} weights at "
             f"{bytes_per_s / 1e12:.3g} TB/s, {source}), so the loop runs at {ms / bound_ms:.3g}× the bound"
             if bound_ms else source)
    text = (f"# Decode speed and generation share, {name}\n\n"
            f"{result['date']}, commit {result['commit']}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, model {opts.model}.\n\n"
            f"- generation share of the μ = 1 runs' seconds: g = {g:.3g} (a training forward: l = {l:.3g}); "
            f"predicted T(4)/T(1) = (1 − g) + (g + l)/4 = {1 - g + (g + l) / 4:.3g}\n"
            f"- decode step (one token for each of {sequences} sequences after {prompt_tokens} prompt "
            f"tokens, sampling included; {STEPS} steps, median of {REPEATS}): {ms:.3g} ms\n"
            f"- bound of reading the weights once per step: {bound}\n")
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
