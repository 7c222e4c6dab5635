"""run.sh's summary of the μ = 1 / μ = 4 pair, from the runs' metrics (OUTPUT_FOLDER/metrics-mu=*.jsonl) and
the demo's own lines in log.txt (its choice of precision and memory): a Markdown page on standard output.

    python experiments/gpu_sweep/pair.py OUTPUT_FOLDER"""
import json
import os
import sys


def row(mu, records):
    last, fresh = records[-1], [r for r in records if r.get("reward") is not None]
    peak = max(r.get("peak_cuda_gib", 0.0) for r in records)  # (none on a CPU)
    seconds = last["elapsed"]
    return (f"| {mu} | {last['step']} | {len(fresh)} | {seconds:.1f} | {seconds / last['step']:.2f} | "
            f"{fresh[-1]['reward']:.1f} | {f'{peak:.2f}' if peak else '—'} |")


def main(out):
    runs = {}
    for mu in (1, 4):
        with open(os.path.join(out, f"metrics-mu={mu}.jsonl")) as f:
            runs[mu] = [json.loads(line) for line in f]
    with open(os.path.join(out, "log.txt")) as f:  # the demo's lines that say how it runs
        choice = [line.rstrip() for line in f if line.startswith(("GPU: ", "preset ", "LoRA ", "model: "))]
    per_step = {mu: records[-1]["elapsed"] / records[-1]["step"] for mu, records in runs.items()}
    print("# The μ = 1 / μ = 4 pair\n\n"
          "| μ | optimizer steps | generation batches | seconds to the last step | s/step | last generation "
          "batch's mean reward | peak torch.cuda.max_memory_allocated (GiB) |\n"
          "|---|---|---|---|---|---|---|\n"
          + "\n".join(row(mu, records) for mu, records in runs.items())
          + f"\n\nμ = 4's seconds per optimizer step ÷ μ = 1's: {per_step[4] / per_step[1]:.2f} (the "
          "first step's warm-up included in both).\n\nThe demo's choice, as it printed it:\n\n"
          + "".join(f"    {line}\n" for line in choice))


if __name__ == "__main__":
    main(sys.argv[1])
