"""The held-out score that every experiment here reports: prompts that never train, sampled from the policy as
training samples them, each completion scored by the training reward.

Sampling, decoding and scoring are the trainer's own (GRPOTrainer.sample_and_score): its max_prompt_length,
max_completion_length, temperature and autocast, its every EOS id (the tokenizer's and the model's
generation config's), completions cut at their first EOS and decoded without special tokens, chats handed
to the reward functions as assistant messages. Only the number of completions per prompt is the score's
own. The random numbers come from one fixed seed, the same for every arm, rate and step, so that two
scores differ by the weights alone; the training run's own random stream goes on untouched.

Run alone, it scores a model (by default the untrained SmolLM2-135M-Instruct) on the held-out posts at the
experiments' shape, from several evaluation seeds: how far one score moves with the random numbers alone.

    python -m experiments.heldout [--model FOLDER] [--samples 2 4] [--seeds 10]
"""
import argparse
import dataclasses
import statistics
import tempfile

import torch
from datasets import Dataset

import grpo_multistep as gm
import train_tldr

EVAL_SEED = 1234


def held_out_score(trainer, prompts, samples, seed=EVAL_SEED):
    """{"eval_reward": mean reward, "eval_chars": mean characters, "eval_truncated": the share that reached
    max_completion_length without an EOS} of `samples` completions per prompt from trainer's model now,
    sampled and scored by the trainer's own sample_and_score, the code path of training."""
    held_out = Dataset.from_dict({"prompt": list(prompts)})
    args = trainer.args
    # sample_and_score draws args.num_generations completions per prompt; the held-out score draws `samples`.
    trainer.args = dataclasses.replace(args, num_generations=samples)
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            sample = trainer.sample_and_score(held_out, list(range(len(held_out))))
    finally:
        trainer.args = args
    return {"eval_reward": sample["rewards"].mean().item(),
            "eval_chars": statistics.mean(map(len, sample["texts"])),
            "eval_truncated": sample["truncated"].float().mean().item()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=train_tldr.OFFLINE_MODEL)
    parser.add_argument("--samples", type=int, nargs="+", default=[2, 4],
                        help="completions per held-out post")
    parser.add_argument("--seeds", type=int, default=10,
                        help=f"evaluation seeds {EVAL_SEED}, {EVAL_SEED + 1}, ...")
    opts = parser.parse_args(argv)
    from experiments.update_clock import SHAPE, TARGET_CHARS  # (it imports this module)
    train, held_out = train_tldr.embedded_prompts()
    reward = train_tldr.length_reward(TARGET_CHARS)
    config = gm.GRPOConfig(**SHAPE, output_dir=tempfile.mkdtemp(prefix="heldout-"))
    trainer = gm.GRPOTrainer(train_tldr.resolve_model(opts.model), reward, args=config,
                             train_dataset=Dataset.from_dict({"prompt": train}))
    for samples in opts.samples:
        seeds = range(EVAL_SEED, EVAL_SEED + opts.seeds)
        scores = [held_out_score(trainer, held_out, samples, seed)["eval_reward"] for seed in seeds]
        print(f"{samples} completions per post, seeds {seeds[0]}-{seeds[-1]}: "
              + ", ".join(f"{x:.1f}" for x in scores) + f"; mean {statistics.mean(scores):.1f}, "
              f"from {min(scores):.1f} to {max(scores):.1f}", flush=True)


if __name__ == "__main__":
    main()
