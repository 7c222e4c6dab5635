"""The held-out score every experiment reports, on the tiny model of test_train_tldr.py, and the metric names
the experiments read (TRL's, or the core's earlier ones)."""
import json

import pytest
import torch

import grpo_multistep as gm
import train_tldr
from experiments.heldout import EVAL_SEED, held_out_score
from experiments.metric_names import clip_fraction, metric
from test_train_tldr import one_thread, tiny  # noqa: F401 (fixtures: one thread, the tiny model)

REWARD = train_tldr.length_reward(40)


@pytest.fixture
def trainer(tiny, tmp_path):
    prompts = [json.loads(line)["prompt"] for line in open(tiny["data"])]
    config = gm.GRPOConfig(num_generations=4, per_device_train_batch_size=4, max_completion_length=8,
                           max_prompt_length=120, output_dir=str(tmp_path))
    return gm.GRPOTrainer(tiny["model"], REWARD, args=config,
                          train_dataset=gm.Dataset.from_dict({"prompt": prompts[:8]}))


def held_out(tiny):
    return [json.loads(line)["prompt"] for line in open(tiny["data"])][8:]


def test_a_score_depends_on_the_weights_alone_and_leaves_the_training_stream_untouched(trainer, tiny):
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = held_out_score(trainer, held_out(tiny), 2)
    assert torch.equal(torch.rand(3), expected)  # the training run draws what it would have drawn
    assert trainer.args.num_generations == 4  # training's config is back as it was
    assert held_out_score(trainer, held_out(tiny), 2, seed=EVAL_SEED) == first
    assert sorted(first) == ["eval_chars", "eval_reward", "eval_truncated"]
    assert first["eval_reward"] <= -abs(40 - first["eval_chars"])  # mean −|40 − n| ≤ −|40 − mean n|


def test_it_decodes_as_training_does_with_the_trainers_eos_ids(trainer, tiny):
    trainer.eos_token_ids = torch.tensor([], dtype=torch.long)  # nothing ends a completion
    whole = held_out_score(trainer, held_out(tiny), 2)
    trainer.eos_token_ids = torch.arange(len(trainer.tokenizer))  # every token ends one, as its first
    first_tokens = held_out_score(trainer, held_out(tiny), 2)
    assert whole["eval_truncated"] == 1.0 and first_tokens["eval_truncated"] == 0.0
    assert first_tokens["eval_chars"] < whole["eval_chars"]  # the same first tokens, nothing after them


def test_metrics_read_under_trl_names_or_the_earlier_ones():
    earlier = {"completion_length": 12.0, "clip_ratio_low": 0.25, "clip_ratio_high": 0.5}
    trl = {"completions/mean_length": 12.0, "clip_ratio/low_mean": 0.25, "clip_ratio/high_mean": 0.5}
    for row in (earlier, trl):
        assert metric(row, "completions/mean_length") == 12.0 and clip_fraction(row) == 0.75
    assert metric({}, "completions/mean_length") is None
