"""A SmolLM2-135M-Instruct of random weights, with the real config and tokenizer, for timing runs on a
machine that the real weights cannot reach (the GPU figures in docs/performance.md).

    python -m experiments.random_smollm2 FOLDER [SOURCE]

SOURCE: a folder with SmolLM2's config and tokenizer; by default the converted model that
`python train_tldr.py` leaves in ~/.cache/grpo_multistep (or $GRPO_MULTISTEP_CACHE)."""
import os
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

cache = os.environ.get("GRPO_MULTISTEP_CACHE", os.path.expanduser("~/.cache/grpo_multistep"))
dst = sys.argv[1]
src = sys.argv[2] if len(sys.argv) > 2 else os.path.join(cache, "SmolLM2-135M-Instruct")
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src), dtype=torch.float32).save_pretrained(dst)
for f in ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(src, f), dst)
print("saved", dst)
