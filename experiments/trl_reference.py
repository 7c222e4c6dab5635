"""TRL's own GRPOTrainer on the benchmark's configuration and prompts: the comparison in
docs/performance.md. Not part of the project, and not run by its tests; it needs TRL, in a venv of its own,
run from the repository's root:

    python3 -m venv /tmp/trl && . /tmp/trl/bin/activate && pip install torch==2.13.0 trl==1.16.0
    python -m experiments.trl_reference PROMPTS.jsonl MODEL_FOLDER STEPS

PROMPTS.jsonl: the cpu preset's prompts (train_tldr.load_prompts("embedded").to_json(...)); MODEL_FOLDER:
the converted SmolLM2-135M-Instruct (~/.cache/grpo_multistep/SmolLM2-135M-Instruct).
TRL 1.16 has no max_prompt_length, so this script cuts each prompt as ours does with
max_prompt_length=64: chat template applied, last 64 tokens kept. TRL gets that as plain text."""

import json
import resource
import statistics
import sys
import time

from datasets import load_dataset
from transformers import AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

prompts, model, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(model)


def last_64_tokens(row):  # what grpo_multistep.tokenize_prompts does with max_prompt_length=64
    text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    return {"prompt": tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"][-64:])}


def reward_len(completions, **kwargs):  # train_tldr.py's reward: 40 characters
    return [-abs(40 - len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


stamps = []


class Clock(TrainerCallback):  # one time stamp at the start and after each optimizer step
    def on_train_begin(self, *args, **kwargs):
        stamps.append(time.perf_counter())

    def on_step_end(self, *args, **kwargs):
        stamps.append(time.perf_counter())


args = GRPOConfig(output_dir="/tmp/trl-reference", per_device_train_batch_size=8,
                  gradient_accumulation_steps=4, num_generations=8, max_completion_length=64, max_steps=steps,
                  learning_rate=2e-5, beta=0.0, loss_type="grpo", logging_steps=1, save_strategy="no",
                  report_to="none", use_cpu=True,
                  # TRL 1.16 defaults both to True; the comparison is float32
                  bf16=False, gradient_checkpointing=False)
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=args, callbacks=[Clock()],
                      train_dataset=load_dataset("json", data_files=prompts,
                                                 split="train").map(last_64_tokens))
trainer.train()
seconds = [b - a for a, b in zip(stamps, stamps[1:])]
print(json.dumps({"seconds_per_step": seconds, "median": statistics.median(seconds),
                  "completion_length": [r.get("completions/mean_length") for r in trainer.state.log_history],
                  "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
