#!/usr/bin/env bash
# train_tldr.py on one GPU, checked in minutes: what the demo chooses for this GPU (bf16 where the card has
# it, and what fits its free memory), the peak memory measured beside tldr/memory.py's estimate, and a short
# μ = 1 / μ = 4 pair of TRL PR #2899's preset with the seconds each took. docs/gpu-sweep/README.md says
# what each file holds; tests/test_train_tldr.py runs this script on a CPU.
#
#   bash experiments/gpu_sweep/run.sh [OUTPUT_FOLDER [MORE_TRAIN_TLDR_FLAGS...]]
#
# OUTPUT_FOLDER: default experiments/gpu_sweep/results. Environment, all optional: STEPS, the pair's optimizer
# steps (8); MEMORY_RUNS, ';'-separated `python -m experiments.measure_memory` arguments (empty: none);
# GIT_COMMIT, where the copy has no .git.
set -euo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/results}
shift $(($# > 0))  # the rest: more flags for train_tldr.py
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$here/../.."  # the repository's root: python -m experiments.NAME finds the package there
exec > >(tee "$out/log.txt") 2>&1
STEPS=${STEPS:-8}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # the pair's final models: GBs that the results do not need

echo "== the machine"
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  echo "commit ${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  python3 -c 'import torch, transformers, tldr.memory as tldr_memory
print("torch", torch.__version__, "transformers", transformers.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), "native bf16:", tldr_memory.native_bf16(),
          "is_bf16_supported (emulation too):", torch.cuda.is_bf16_supported())
else:
    print("no GPU")'
} | tee "$out/machine.txt"

echo "== the demo's choice at the pr2899 shapes (Qwen2.5-0.5B's config): this GPU, 8, 12 and 16 GB cards"
python3 -m experiments.measure_memory qwen2.5-0.5b pr2899 --fit | tee "$out/fit.txt"
for precision in --bf16 ""; do
  python3 -m experiments.measure_memory qwen2.5-0.5b pr2899 $precision --fit 7.5 11.5 15.5 |
    tee -a "$out/fit.txt"
done

# One step after the first (AdamW's moments held) of Qwen2.5-0.5B's config with random weights (nothing is
# downloaded): torch.cuda.max_memory_allocated beside the estimate, bf16 on and off, with checkpointing
default="qwen2.5-0.5b pr2899 --steps 2 --bf16;qwen2.5-0.5b pr2899 --steps 2 --bf16 --gradient_checkpointing"
default+=";qwen2.5-0.5b pr2899 --steps 2"
IFS=';' read -ra runs <<<"${MEMORY_RUNS-$default}"
touch "$out/memory.txt"
for run in "${runs[@]}"; do
  echo "== python3 -m experiments.measure_memory $run"
  python3 -m experiments.measure_memory $run | tee -a "$out/memory.txt"
done

# --logging_steps 1: a metrics line per optimizer step (the preset logs every 5th), which pair.py counts
pair=(python3 train_tldr.py --sweep 1 4 --max_steps "$STEPS" --logging_steps 1
      --output_dir "$work/pair-mu={mu}" "$@")
echo "== ${pair[*]}"
"${pair[@]}"
cp "$work/pair-mu=1,4/rewards.png" "$out/"
for mu in 1 4; do
  cp "$work/pair-mu=$mu/metrics.jsonl" "$out/metrics-mu=$mu.jsonl"
done
python3 experiments/gpu_sweep/pair.py "$out" | tee "$out/pair.md"
echo "== written to $out:" $(ls "$out")
