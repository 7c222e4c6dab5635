"""Generation alone, A/B: the sampling loop of each checkout on the same prompts, seeds and model.

    python docs/performance/generation_ab.py [--repeats 3] LABEL=FOLDER [LABEL=FOLDER ...]

Each FOLDER is a checkout of the project. For each seed, every folder's `generate_completions` samples
4 prompts × 8 completions of at most 64 tokens (the benchmark's shape) from SmolLM2-135M-Instruct, each
in a fresh process, in turn. Completions that are sampled differently end at different lengths, so it
prints the seconds per call and the decode steps the call ran (its longest completion), and compares
seconds per decode step. Run from the repository root (it needs train_tldr.py's model and prompts).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = (r"""
import json, sys, time, torch
sys.path.insert(0, sys.argv[1])
import grpo_multistep as gm
import train_tldr
from transformers import AutoModelForCausalLM, AutoTokenizer
folder = train_tldr.smollm2_folder()
model, tok = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), """
         r"""AutoTokenizer.from_pretrained(folder)
prompts = train_tldr.load_prompts("embedded")["prompt"][:4]
args = gm.GRPOConfig(num_generations=8, max_completion_length=64, max_prompt_length=64)
ids, mask = gm.tokenize_prompts(tok, prompts, 64)
torch.manual_seed(int(sys.argv[2]))
start = time.perf_counter()
out = gm.generate_completions(model.train(), tok, ids, mask, args)
seconds = time.perf_counter() - start
lengths = out[3].sum(1)
print(json.dumps({"seconds": seconds, "steps": int(lengths.max()), """
         r""""mean_length": float(lengths.float().mean())}))
""")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+", help="LABEL=FOLDER")
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    versions = dict(v.split("=", 1) for v in opts.versions)
    results = {label: [] for label in versions}
    for seed in range(opts.repeats):
        for label, folder in versions.items():
            run = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(folder), str(seed)],
                                 capture_output=True, text=True, check=True)
            got = json.loads(run.stdout.strip().splitlines()[-1])
            results[label].append(got)
            print(f"seed {seed} {label}: {got['seconds']:.2f} s, {got['steps']} decode steps, "
                  f"mean length {got['mean_length']:.1f}", flush=True)
    print("\n| version | s per call (median) | decode steps (median) | ms per decode step (median) |")
    print("|---|---|---|---|")
    for label, runs in results.items():
        per_step = statistics.median(1000 * r["seconds"] / r["steps"] for r in runs)
        print(f"| {label} | {statistics.median(r['seconds'] for r in runs):.2f} | "
              f"{statistics.median(r['steps'] for r in runs)} | {per_step:.0f} |")


if __name__ == "__main__":
    main()
