"""The invariants of GRPO with μ-step optimization, as executable checks.

Everything runs offline on a tiny Llama (2 layers, hidden size 32) and a byte-level BPE tokenizer
trained here on a few sentences, so the whole file takes seconds on a CPU.
"""

import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy
import pytest
import safetensors.torch
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

import grpo_multistep as gm
from grpo_multistep import (GRPOConfig, GRPOTrainer, completion_mask, group_advantages, grpo_loss,
                            per_token_logps)

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)  # a 32-wide model gains nothing from threads, and loses a lot to a busy machine
CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "tl;dr: it was fine"] * 10
PROMPTS = ["the cat", "a dog", "hello", "tl;dr:", "the park", "world", "it was", "on the mat"]


# ---------------------------------------------------------------------------------------------------
# Tiny, deterministic building blocks
# ---------------------------------------------------------------------------------------------------
def make_tokenizer(pad_is_eos=False):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                                        pad_token="<eos>" if pad_is_eos else "<pad>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}")
    return tokenizer


def make_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    return LlamaForCausalLM(config)


def plain_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The model's own logits over prompt + completion: one pass, no cache, no sharing."""
    mask = torch.cat([prompt_mask, completion_mask], 1)
    return model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                 position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits                 # (b, P+C, V)


def short_is_good(completion_ids, **kwargs):
    """A toy reward a random model can learn: the share of a completion's tokens with an id below 150."""
    return [sum(t < 150 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def make_trainer(tmp_path, reward_funcs=short_is_good, dataset=None, tokenizer=None, model=None,
                 peft_config=None, **overrides):
    tokenizer = tokenizer or make_tokenizer()
    config = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16,
                  max_completion_length=12, max_steps=2,
                  learning_rate=1e-2, logging_steps=1, max_grad_norm=0.0, seed=0)
    config.update(overrides)
    dataset = dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS})
    return GRPOTrainer(model or make_model(tokenizer), reward_funcs, GRPOConfig(**config), dataset, tokenizer,
                       peft_config=peft_config)


def first_step_gradients(trainer):
    """Run the trainer's first optimizer step and return the gradients it applied (clipping is off)."""
    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.extend(p.grad.clone() for p in trainer.model.parameters()))
    torch.manual_seed(trainer.args.seed)
    trainer.batch, _ = trainer.generate_and_score(0)
    trainer.optimizer_step(trainer.batch)
    return grads


# ---------------------------------------------------------------------------------------------------
# The multi-step trick: μ = 1 is plain GRPO; μ > 1 starts from ratio 1; caches are computed once
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_mu1_gradient_equals_detached_ratio_gradient_exactly(tmp_path, loss_type):
    """With μ = 1, old_logp = logp.detach(): the clipped loss's gradient is bit for bit that of the
    single-step GRPO loss -exp(logp - logp.detach()) · A with the same reduction. bnpo's is TRL PR #2899's
    as written there: each micro-batch's token mean, divided by the accumulation steps."""
    trainer = make_trainer(tmp_path, loss_type=loss_type)
    reference = make_trainer(tmp_path, loss_type=loss_type)  # same weights, same seed
    grads = first_step_gradients(trainer)

    batch, args = trainer.batch, reference.args
    for mb in gm.micro_batches(batch, args.per_device_train_batch_size):
        logps = per_token_logps(reference.model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                mb["completion_mask"], args.temperature)[0]
        per_token_loss = -torch.exp(logps - logps.detach()) * mb["advantages"][:, None]
        mask = mb["completion_mask"]
        if loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / batch["num_seqs"]
        elif loss_type == "dapo":
            loss = (per_token_loss * mask).sum() / batch["num_tokens"]
        elif loss_type == "bnpo":  # on micro-batches of unequal token counts (else it would be dapo's)
            assert mask.sum() != batch["num_tokens"] / args.gradient_accumulation_steps
            loss = (per_token_loss * mask).sum() / mask.sum() / args.gradient_accumulation_steps
        else:
            loss = (per_token_loss * mask).sum() / (batch["num_seqs"] * args.max_completion_length)
        loss.backward()
    assert any(g.abs().sum() > 0 for g in grads)
    for g, p in zip(grads, reference.model.parameters()):
        assert torch.equal(g, p.grad)


def test_mu2_first_step_has_ratio_one_and_the_mu1_gradient(tmp_path):
    trainer_mu2 = make_trainer(tmp_path, num_iterations=2)
    grads_mu2 = first_step_gradients(trainer_mu2)
    grads_mu1 = first_step_gradients(make_trainer(tmp_path, num_iterations=1))

    # The cached π_old log-probs equal the first training forward's: ratio exactly 1, nothing clipped.
    batch = trainer_mu2.batch
    fresh = gm.cached_logps(make_trainer(tmp_path), make_model(make_tokenizer()).to(trainer_mu2.device),
                            batch)
    assert torch.equal(batch["old_logps"], fresh)
    for g1, g2 in zip(grads_mu1, grads_mu2):
        assert torch.equal(g1, g2)


@pytest.mark.parametrize("mu,S,beta", [(1, 1, 0), (3, 1, 0), (1, 1, 0.1), (3, 1, 0.1), (1, 2, 0),
                                       (2, 2, 0.1)])
def test_generation_and_cached_logps_happen_once_per_generation_batch(tmp_path, monkeypatch, mu, S, beta):
    """A generation batch of S mini-batches serves μ·S optimizer steps: one generation, one π_old pass
    (unless μ·S = 1, where the training pass's own log-probs are π_old's) and one π_ref pass (β > 0)."""
    trainer = make_trainer(tmp_path, num_iterations=mu, beta=beta, max_steps=2 * mu * S,
                           steps_per_generation=2 * S)
    calls = {"generate": 0, "policy": 0, "reference": 0, "policy_no_grad": 0}
    generate, logps = gm.generate_completions, gm.per_token_logps

    def counting_generate(*a, **k):
        calls["generate"] += 1
        return generate(*a, **k)

    def counting_logps(model, *a, **k):
        who = "reference" if model is trainer.ref_model else "policy"
        calls[who] += 1
        calls["policy_no_grad"] += who == "policy" and not torch.is_grad_enabled()
        return logps(model, *a, **k)

    monkeypatch.setattr(gm, "generate_completions", counting_generate)
    monkeypatch.setattr(gm, "per_token_logps", counting_logps)
    trainer.train()
    micro = trainer.args.gradient_accumulation_steps
    assert calls["generate"] == 2                                   # 2 generation batches for 2·μ·S steps
    assert calls["policy_no_grad"] == (2 * S * micro if mu * S > 1 else 0)  # π_old: once per batch
    assert calls["policy"] == 2 * mu * S * micro + calls["policy_no_grad"]
    assert calls["reference"] == (2 * S * micro if beta > 0 else 0)  # π_ref: once per batch, none when β = 0
    assert (trainer.ref_model is None) == (beta == 0)


def test_steps_per_generation_of_one_optimizer_step_is_the_default_loop_bit_for_bit(tmp_path):
    """steps_per_generation = gradient_accumulation_steps (TRL's default, None here) is the loop
    without it."""
    assert_same_run(run_to_end(tmp_path, "none"), run_to_end(tmp_path, "ga", steps_per_generation=2))


def test_the_readmes_worked_schedule(tmp_path, monkeypatch):
    """README's example: gradient_accumulation_steps = 2, steps_per_generation = 8, num_iterations = 2,
    max_steps = 32. A generation batch holds S = 8 / 2 = 4 mini-batches and serves μ·S = 8 steps: it
    generates before steps 1, 9, 17 and 25, and steps 1-8 use mini-batches 0 1 2 3 0 1 2 3 (two passes)."""
    trainer = make_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           steps_per_generation=8, num_iterations=2, max_steps=32, max_completion_length=4)
    generated_before, used, split = [], [], gm.mini_batches
    generate_and_score, optimizer_step = trainer.generate_and_score, trainer.optimizer_step

    def generate(k):
        generated_before.append(trainer.step + 1)  # the step about to be taken, counted from 1
        return generate_and_score(k)

    def cut(batch, S):
        trainer.cut = split(batch, S)
        return trainer.cut

    def step(minibatch):
        used.append([i for i, m in enumerate(trainer.cut) if m is minibatch])
        return optimizer_step(minibatch)

    monkeypatch.setattr(gm, "mini_batches", cut)
    trainer.generate_and_score, trainer.optimizer_step = generate, step
    trainer.train()
    assert generated_before == [1, 9, 17, 25]
    assert [u for (u,) in used] == [0, 1, 2, 3, 0, 1, 2, 3] * 4
    assert len(trainer.batch["advantages"]) == 32 and len(trainer.cut[0]["advantages"]) == 8  # 4 × 2 a step


def test_steps_per_generation_cuts_a_generation_batch_into_fresh_mini_batches_against_its_pi_old(tmp_path):
    """S = 2: one generation batch of 2 optimizer steps' completions. Its first mini-batch has ratio 1 and
    μ = 1's gradient; the second is stale: the update before it moved π_θ off the cached π_old, so its
    ratio is no longer 1 and the clip acts against π_old (against the current weights it could not)."""
    trainer = make_trainer(tmp_path, steps_per_generation=4, learning_rate=0.1)  # S = 4 / 2
    torch.manual_seed(0)
    batch, _ = trainer.generate_and_score(0)
    first, second = gm.mini_batches(batch, 2)  # two mini-batches of one optimizer step's 8 completions
    assert len(batch["advantages"]) == 16 and batch["num_seqs"] == 8  # normalizers: one step's share
    assert batch["num_tokens"] == batch["completion_mask"].sum() / 2  # TRL's dapo: the batch's mean per step
    mu1 = make_trainer(tmp_path)  # the same weights; without old_logps it takes π_old = π_θ detached
    grads = {}
    for name, t in (("S=2", trainer), ("μ=1", mu1)):
        t.optimizer.register_step_pre_hook(lambda *_, name=name, t=t: grads.update(
            {name: [p.grad.clone() for p in t.model.parameters()]}))
    trainer.optimizer_step(first)
    mu1.optimizer_step({k: v for k, v in first.items() if k != "old_logps"})
    assert all(torch.equal(a, b) for a, b in zip(grads["S=2"], grads["μ=1"]))
    metrics = trainer.optimizer_step(second)
    assert metrics["clip_ratio_low"] + metrics["clip_ratio_high"] > 0


# ---------------------------------------------------------------------------------------------------
# The clipped objective, term by term
# ---------------------------------------------------------------------------------------------------
def loss_on(logps, old_logps, advantages, ref_logps=None, **overrides):
    args = GRPOConfig(**{"loss_type": "dapo", **overrides})
    mask = torch.ones_like(logps)
    return grpo_loss(logps, old_logps, ref_logps, advantages, mask, args, logps.size(0), mask.sum())


def test_clipped_tokens_get_zero_gradient_for_both_signs_of_the_advantage():
    # Ratios exp(logp - old_logp) of 0.5, 0.9, 1.1, 1.5 for a sequence with A > 0 and one with A < 0.
    ratios = torch.tensor([[0.5, 0.9, 1.1, 1.5], [0.5, 0.9, 1.1, 1.5]])
    old_logps = torch.full((2, 4), -2.0)
    logps = (old_logps + ratios.log()).requires_grad_()
    loss, stats = loss_on(logps, old_logps, torch.tensor([1.0, -1.0]), epsilon=0.2)
    loss.backward()
    # A > 0: only the ratio above 1 + ε is clipped. A < 0: only the ratio below 1 - ε.
    assert (logps.grad[0] == 0).tolist() == [False, False, False, True]
    assert (logps.grad[1] == 0).tolist() == [True, False, False, False]
    # The clip-ratio metrics count exactly those tokens.
    assert (stats["clip_high"].item(), stats["clip_low"].item()) == (1, 1)


def test_clip_range_is_asymmetric_with_epsilon_high():
    old_logps = torch.zeros(1, 2)
    logps = torch.log(torch.tensor([[1.25, 1.35]])).requires_grad_()
    loss, stats = loss_on(logps, old_logps, torch.tensor([1.0]), epsilon=0.2, epsilon_high=0.28)
    loss.backward()
    assert (logps.grad[0] == 0).tolist() == [False, True]
    assert stats["clip_high"].item() == 1


def test_gspo_clips_a_whole_completion_on_the_geometric_mean_of_its_tokens_ratios():
    """importance_sampling_level="sequence": one ratio per completion, exp(mean_t log ρ_t). Ratios 1.5 and
    1.0 average to a log-ratio of log(1.5) / 2, a ratio of 1.22 > 1 + ε: with A > 0 the whole completion is
    clipped (no gradient at either token), where the token-level ratio clips only the first token."""
    old_logps = torch.zeros(1, 2)
    per_token = torch.log(torch.tensor([[1.5, 1.0]]))
    for level, zero in (("token", [True, False]), ("sequence", [True, True])):
        logps = per_token.clone().requires_grad_()
        loss, stats = loss_on(logps, old_logps, torch.tensor([1.0]), importance_sampling_level=level)
        loss.backward()
        assert (logps.grad[0] == 0).tolist() == zero, level
        assert stats["clip_high"].item() == (2 if level == "sequence" else 1)  # the clipped tokens


def test_at_ratio_one_gspos_gradient_is_grpos():
    """At ρ = 1 (μ = 1, or a batch's first step) d exp(mean_t log ρ_t) = mean_t d log π_θ(o_t): the
    sequence-level loss has the per-sequence-mean (grpo) loss's gradient."""
    logps = torch.randn(3, 5)
    advantages, grads = torch.tensor([1.0, -0.5, 0.25]), []
    for level in ("token", "sequence"):
        x = logps.clone().requires_grad_()
        loss_on(x, x.detach(), advantages, loss_type="grpo", importance_sampling_level=level)[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-7)


def test_the_loss_needs_only_the_configs_fields_and_reads_epsilon_high_none_as_epsilon():
    """grpo_loss copied alone works on any object with GRPOConfig's fields; epsilon_high=None
    means ε (TRL)."""
    fields = dict(epsilon=0.1, beta=0.0, loss_type="grpo", max_completion_length=4,
                  importance_sampling_level="token")
    old_logps, advantages = torch.zeros(2, 4), torch.tensor([1.0, -1.0])
    results = []
    for epsilon_high in (None, 0.1):
        logps = torch.log(torch.tensor([[0.85, 0.95, 1.05, 1.15]] * 2)).requires_grad_()
        loss, stats = grpo_loss(logps, old_logps, None, advantages, torch.ones(2, 4),
                                types.SimpleNamespace(**fields, epsilon_high=epsilon_high), 2, 8)
        loss.backward()
        results.append((loss, logps.grad, stats["clip_low"], stats["clip_high"]))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    # 0.85 < 1 - ε with A < 0; 1.15 > 1 + ε, A > 0
    assert (results[0][2].item(), results[0][3].item()) == (1, 1)


def test_kl_is_zero_with_zero_gradient_while_policy_equals_reference():
    logps = torch.randn(3, 5).requires_grad_()
    loss, stats = loss_on(logps, logps.detach(), torch.zeros(3), ref_logps=logps.detach().clone(), beta=0.5)
    loss.backward()
    assert stats["kl"].item() == 0.0 and loss.item() == 0.0
    assert torch.equal(logps.grad, torch.zeros_like(logps))


def test_kl_penalty_pulls_the_policy_back_towards_the_reference():
    ref_logps = torch.full((1, 3), -1.0)
    logps = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
    loss, stats = loss_on(logps, logps.detach(), torch.zeros(1), ref_logps=ref_logps, beta=1.0)
    loss.backward()
    assert stats["kl"].item() > 0
    # Descending the loss moves each log-prob towards the reference's.
    assert logps.grad[0, 0] > 0 and logps.grad[0, 1] == 0 and logps.grad[0, 2] < 0


def test_the_bias_corrected_kl_is_the_k3_estimate_weighed_by_the_ratio():
    """use_bias_correction_kl (TRL 1.16): the k3 term times ρ = π_θ / π_old, which estimates KL(π_θ ‖ π_ref)
    from π_old's samples; its gradient flows through ρ too. With A = 0 only the KL term is left."""
    logps = torch.tensor([[-0.5, -1.0, -1.5]], requires_grad=True)
    old_logps, ref_logps = torch.tensor([[-0.7, -1.0, -1.2]]), torch.full((1, 3), -1.0)
    loss, stats = loss_on(logps, old_logps, torch.zeros(1), ref_logps=ref_logps, beta=0.5,
                          use_bias_correction_kl=True)
    ratio, k3 = torch.exp(logps - old_logps), torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
    expected = 0.5 * (ratio * k3).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(stats["kl"], (ratio * k3).sum().detach(), rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(expected, logps)
    loss.backward()
    torch.testing.assert_close(logps.grad, grad, rtol=1e-6, atol=0)
    plain, _ = loss_on(logps, old_logps, torch.zeros(1), ref_logps=ref_logps, beta=0.5)
    assert not torch.allclose(plain, loss)  # off-policy (ρ ≠ 1) the two differ


def test_trainer_reports_zero_kl_on_its_first_step(tmp_path):
    trainer = make_trainer(tmp_path, beta=0.1)
    trainer.batch, _ = trainer.generate_and_score(0)
    assert trainer.optimizer_step(trainer.batch)["kl"] == 0.0


# ---------------------------------------------------------------------------------------------------
# Rewards and group-normalized advantages
# ---------------------------------------------------------------------------------------------------
def test_advantages_are_rewards_normalized_within_each_group():
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 10.0, 10.0])
    std = math.sqrt(((torch.tensor([1.0, 2, 3, 4]) - 2.5) ** 2).sum().item() / 3)  # unbiased, as in the paper
    expected = [(r - 2.5) / (std + 1e-4) for r in (1, 2, 3, 4)] + [0.0] * 4
    assert group_advantages(rewards, 4).tolist() == pytest.approx(expected, abs=1e-6)
    # Dr. GRPO: centred but not scaled.
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0])


def test_a_group_of_equal_rewards_has_exactly_zero_advantage():
    rewards = torch.tensor([0.1, 0.1, 0.1, -7.3, -7.3, -7.3])  # float means of these are not exact
    assert torch.equal(group_advantages(rewards, 3), torch.zeros(6))


def test_equal_rewards_give_zero_policy_gradient(tmp_path):
    grads = first_step_gradients(
        make_trainer(tmp_path, reward_funcs=lambda completions, **kw: [1.0] * len(completions)))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_several_reward_functions_are_weighted_and_none_means_does_not_apply(tmp_path):
    def one(completions, **kw):
        return [1.0] * len(completions)

    def sometimes(completions, **kw):
        return [None if i % 2 else 3.0 for i in range(len(completions))]

    trainer = make_trainer(tmp_path, reward_funcs=[one, sometimes], reward_weights=[2.0, 0.5])
    _, stats = trainer.generate_and_score(0)
    assert stats["reward"] == pytest.approx((2.0 + 2.0 + 1.5) / 2)  # None adds nothing
    assert stats["rewards/one"] == 1.0 and stats["rewards/sometimes"] == 3.0


def test_reward_functions_get_the_dataset_columns_and_completion_ids(tmp_path):
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer)
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": PROMPTS, "answer": [p.upper() for p in PROMPTS]})
    trainer = make_trainer(tmp_path, reward_funcs=spy, dataset=dataset)
    trainer.generate_and_score(0)
    assert len(seen["prompts"]) == len(seen["completions"]) == len(seen["ids"]) == 8
    assert [a.lower() for a in seen["answer"]] == seen["prompts"]         # columns stay aligned with prompts
    assert seen["prompts"][:4] == [seen["prompts"][0]] * 4                 # G adjacent copies of each prompt
    assert seen["completions"][0] == trainer.tokenizer.decode(seen["ids"][0], skip_special_tokens=True)


def test_conversational_prompts_go_through_the_chat_template(tmp_path):
    seen = {}

    def spy(prompts, completions, **kw):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = make_trainer(tmp_path, reward_funcs=spy, dataset=dataset)
    ids, _ = gm.tokenize_prompts(trainer.tokenizer, [dataset[0]["prompt"]], None)
    assert trainer.tokenizer.decode(ids[0]) == "user: the cat\nassistant:"
    trainer.generate_and_score(0)
    assert seen["completions"][0][0]["role"] == "assistant"


# ---------------------------------------------------------------------------------------------------
# Generation, masks and per-token log-probs
# ---------------------------------------------------------------------------------------------------
def test_completion_mask_keeps_tokens_up_to_and_including_the_first_eos():
    eos = 1
    ids = torch.tensor([[5, 6, eos, eos, eos], [5, 6, 7, 8, 9], [eos, 0, 0, 0, 0]])
    assert completion_mask(ids, eos).tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_any_of_several_eos_ids_ends_generation_and_the_mask_at_the_first(tmp_path, monkeypatch):
    """TRL's rule: the tokenizer's EOS and every id in the model's generation_config.eos_token_id end a
    completion (instruct models often list several, e.g. <|eot_id|> beside <|end_of_text|>)."""
    ids = torch.tensor([[5, 7, 6, 1, 9], [5, 1, 7, 0, 0]])
    assert completion_mask(ids, [1, 7]).tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]
    trainer = make_trainer(tmp_path, model=model, tokenizer=tokenizer)
    assert trainer.eos_token_ids.tolist() == sorted({tokenizer.eos_token_id, 7})
    sample, steps = gm.sample_token, []

    def seven_at_step_3(logits, temperature):  # the model's second EOS id ends every completion at step 3
        steps.append(1)
        token = sample(logits, temperature)
        token[token == tokenizer.eos_token_id] = 2
        return torch.full_like(token, 7) if len(steps) == 3 else token.masked_fill(token == 7, 2)

    monkeypatch.setattr(gm, "sample_token", seven_at_step_3)
    batch, _ = trainer.generate_and_score(0)
    assert len(steps) == 3 and batch["completion_ids"].size(1) == 3  # generation stopped there
    assert batch["completion_mask"].sum(1).eq(3).all()               # and the mask ends with the 7


def test_checking_for_the_end_every_few_tokens_samples_the_same_tokens(monkeypatch):
    """On a GPU `done.all()` waits for the device, so it is checked every DONE_CHECK tokens: that only adds
    padding columns after the last EOS; the completions and their masks are the same."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    ids, mask = gm.tokenize_prompts(tokenizer, ["hello world", "the cat sat on the mat"], None)
    args = GRPOConfig(num_generations=4, max_completion_length=40)
    sample, runs, steps = gm.sample_token, [], []

    def row_t_ends_at_step_t(logits, temperature):  # the 8 completions end one by one, by step 8
        token = sample(logits, temperature)
        token[token == tokenizer.eos_token_id] = 2
        steps.append(1)
        token[:len(steps)] = tokenizer.eos_token_id
        return token

    monkeypatch.setattr(gm, "sample_token", row_t_ends_at_step_t)
    for every in (1, 8):
        monkeypatch.setitem(gm.DONE_CHECK, "cpu", every)
        torch.manual_seed(0)
        steps.clear()
        runs.append(gm.generate_completions(model, tokenizer, ids, mask, args)[2:])
    (ids_1, mask_1), (ids_8, mask_8) = runs
    assert ids_1.size(1) < 40 and ids_8.size(1) > ids_1.size(1)      # all ended early; checked later
    assert torch.equal(ids_8[:, :ids_1.size(1)], ids_1) and torch.equal(mask_8[:, :ids_1.size(1)], mask_1)
    assert (ids_8[:, ids_1.size(1):] == tokenizer.pad_token_id).all() and mask_8[:, ids_1.size(1):].sum() == 0


def test_eos_is_trainable_when_pad_is_eos(tmp_path):
    tokenizer = make_tokenizer(pad_is_eos=True)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    ids = torch.tensor([[7, 8, tokenizer.eos_token_id, tokenizer.eos_token_id]])
    mask = completion_mask(ids, tokenizer.eos_token_id)
    logps = torch.full((1, 4), -1.0, requires_grad=True)
    args = GRPOConfig()
    loss, _ = grpo_loss(logps, logps.detach(), None, torch.tensor([1.0]), mask, args, 1, mask.sum())
    loss.backward()
    assert logps.grad[0].ne(0).tolist() == [True, True, True, False]  # the EOS learns, the padding doesn't


def test_prompts_are_truncated_from_the_left_with_one_warning():
    tokenizer = make_tokenizer()
    long_prompt = "the cat sat on the mat " * 5
    with pytest.warns(UserWarning, match="max_prompt_length=4"):
        ids, mask = gm.tokenize_prompts(tokenizer, [long_prompt, "hello"], 4)
    full = tokenizer(long_prompt, add_special_tokens=False)["input_ids"]
    assert ids[0].tolist() == full[-4:]                                   # the end of the prompt is kept
    assert mask[1].tolist()[0] == 0 and ids.shape == (2, 4)               # the short one is left-padded


def test_text_prompts_keep_the_bos_that_the_tokenizer_adds_and_chats_get_only_their_templates():
    """As TRL: a text prompt is tokenized as the tokenizer does by default (a Llama-style tokenizer adds <s>);
    a conversation is rendered by its chat template, which writes its own special tokens."""
    tokenizer = make_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                               special_tokens=[("<s>", bos)])
    ids, mask = gm.tokenize_prompts(tokenizer, ["hello world", "the cat"], None)
    # each prompt starts with it
    assert ids[mask.bool()].tolist().count(bos) == 2 and ids[1, -3].item() == bos
    chat, _ = gm.tokenize_prompts(tokenizer, [[{"role": "user", "content": "hello"}]], None)
    assert bos not in chat[0].tolist()  # this template writes none: none is added


def test_left_padding_does_not_change_log_probs():
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    ids, mask = gm.tokenize_prompts(tokenizer, ["hello world", "the cat sat on the mat"], None)
    completion = torch.tensor([[40, 50, 60], [40, 50, 60]])
    padded = per_token_logps(model, ids, mask, completion, torch.ones_like(completion), 1.0)[0]
    alone_ids = torch.tensor([tokenizer("hello world", add_special_tokens=False)["input_ids"]])
    alone = per_token_logps(model, alone_ids, torch.ones_like(alone_ids), completion[:1], torch.ones(1, 3),
                            1.0)[0]
    assert mask[0, 0] == 0                                                # row 0 really is left-padded
    torch.testing.assert_close(padded[0], alone[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, False), (0.7, True)])
def test_lean_chunked_log_probs_equal_log_softmax_of_tempered_logits(temperature, bias, monkeypatch):
    """The lean path (hidden states -> LM head in chunks of 5 tokens -> logit - logsumexp, and a
    hand-written backward, onehot(y) - softmax(z)) gives the log-probs and the gradients of the plain
    log_softmax of the model's tempered logits, for any weight of each token in the loss."""
    monkeypatch.setattr(gm, "CHUNK", 5)
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    if bias:  # an LM head with a bias (GPT-2-style heads have none, but the backward must not drop it)
        model.lm_head.bias = torch.nn.Parameter(torch.randn(len(tokenizer)))
    ids = torch.randint(2, len(tokenizer), (3, 10))
    weights = torch.randn(3, 4)  # ∂loss/∂log π of each token: each row must be scaled by its own
    lean = per_token_logps(model, ids[:, :6], torch.ones(3, 6), ids[:, 6:], torch.ones(3, 4), temperature)[0]
    (lean * weights).sum().backward()
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = model(input_ids=ids).logits[:, -5:-1] / temperature
    plain = logits.log_softmax(-1).gather(-1, ids[:, -4:, None]).squeeze(-1)
    (plain * weights).sum().backward()
    torch.testing.assert_close(lean, plain, rtol=0, atol=1e-5)
    for a, p in zip(lean_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_the_lm_head_backward_reruns_the_head_under_the_bf16_autocast_of_its_forward():
    """bf16=True runs per_token_logps under autocast. TokenLogps's backward must compute a chunk's logits
    again in bfloat16, as its forward did, or its softmax would not be that of the log-probs it returned
    (large logits make the bf16 rounding, up to 0.25 here, move the softmax by several percent)."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(6, 16, requires_grad=True), (10 * torch.randn(50, 16)).requires_grad_()
    targets, weights = torch.randint(50, (6,)), torch.randn(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lean = gm.TokenLogps.apply(hidden, targets, 0.7, weight, None)[0]
        logits = torch.nn.functional.linear(hidden, weight).float() / 0.7  # bf16 products, as bf16=True
        plain = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lean, plain, rtol=0, atol=1e-5)
    lean_grads = torch.autograd.grad((lean * weights).sum(), (hidden, weight))
    plain_grads = torch.autograd.grad((plain * weights).sum(), (hidden, weight))
    for a, b in zip(lean_grads, plain_grads):  # autograd's backward multiplies in bf16, TokenLogps in float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_sampling_draws_tokens_with_the_probabilities_of_the_tempered_softmax():
    logits = torch.tensor([[2.0, 0.0, -1.0, -3.0, -math.inf]]).expand(200_000, -1)
    torch.manual_seed(0)
    freq = torch.bincount(gm.sample_token(logits, 0.7), minlength=5) / len(logits)
    torch.testing.assert_close(freq, (logits[0] / 0.7).softmax(-1), rtol=0, atol=3e-3)  # 5 σ at 200k draws
    assert freq[-1] == 0                                         # a token of probability 0 is never drawn


def test_generation_shares_each_prompts_cache_and_samples_from_the_plain_forward_pass(monkeypatch):
    """generate_completions prefills each prompt once for its G completions; still, at every step it samples
    from the logits that a plain forward pass over prompt + completion-so-far gives, after each EOS comes
    padding, and it stops once every completion has ended."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    ids, mask = gm.tokenize_prompts(tokenizer, ["hello world", "the cat sat on the mat"], None)  # left-padded
    seen, rows_in, sample = [], [], gm.sample_token

    def sample_and_end_row_t_at_step_t(logits, temperature):
        seen.append(logits.clone())
        token = sample(logits, temperature)
        token[token == tokenizer.eos_token_id] = 2     # no completion ends by chance, and
        token[len(seen) - 1] = tokenizer.eos_token_id  # completion t ends at step t
        return token

    monkeypatch.setattr(gm, "sample_token", sample_and_end_row_t_at_step_t)
    model.get_input_embeddings().register_forward_hook(
        lambda module, inputs, out: rows_in.append(inputs[0].shape))
    args = GRPOConfig(num_generations=3, max_completion_length=8, temperature=0.7)
    prompt_ids, prompt_mask, completion_ids, completion_mask = gm.generate_completions(model, tokenizer, ids,
                                                                                     mask, args)
    assert torch.equal(prompt_ids, ids.repeat_interleave(3, 0))
    assert torch.equal(prompt_mask, mask.repeat_interleave(3, 0))
    assert completion_mask.sum(1).tolist() == [1, 2, 3, 4, 5, 6]
    assert (completion_ids[completion_mask == 0] == tokenizer.pad_token_id).all()
    assert rows_in == [ids.shape] + [(6, 1)] * 5  # 2 prompts once, then 5 decode steps: the 6th ends them all
    plain = plain_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    for t, logits in enumerate(seen):
        going = completion_mask[:, t].bool()
        torch.testing.assert_close(logits[going], plain[going, ids.size(1) - 1 + t], rtol=0, atol=1e-4)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_completions_of_a_prompt_share_its_forward_pass_and_get_the_plain_log_probs(checkpointing):
    """per_token_logps runs each prompt once for its group (not with gradient checkpointing, which cannot
    keep a KV cache), and gives the log-probs and gradients of Part I's plain definition, which are those of
    the model's own logits."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids, mask = gm.tokenize_prompts(tokenizer, ["hello world", "the cat sat on the mat"], None)
    prompt_ids, prompt_mask = ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)       # 2 groups of 3
    completion_ids = torch.randint(2, len(tokenizer), (6, 5))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 3:] = completion_mask[4, 1:] = 0                                        # ended early
    rows_in = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda m, inputs, out: rows_in.append(len(inputs[0])))
    lean = (per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)[0]
            * completion_mask)
    lean.sum().backward()
    hook.remove()
    assert rows_in == ([6] if checkpointing else [2, 6])   # shared: the 2 prompts, then the 6 completions
    lean_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain = gm.plain_per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
    (plain * completion_mask).sum().backward()
    torch.testing.assert_close(lean, plain * completion_mask, rtol=0, atol=1e-5)
    logits = plain_logits(model, prompt_ids, prompt_mask, completion_ids,
                          completion_mask)[:, ids.size(1) - 1:-1]
    # the model's own
    by_hand = (logits / 0.7).log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(plain, by_hand, rtol=0, atol=1e-5)
    for a, p in zip(lean_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_attention_dropout_is_turned_off_like_the_rest(tmp_path):
    """π_old = π_θ (μ = 1, and the first of μ steps) needs the same weights to give the same log-probs:
    the attention's own dropout goes too, not only the nn.Dropout modules."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    trainer = make_trainer(tmp_path, model=model, tokenizer=tokenizer)
    mb = next(gm.micro_batches(trainer.generate_and_score(0)[0], 8))
    first, second = (per_token_logps(trainer.model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                     mb["completion_mask"], 1.0)[0] for _ in range(2))
    assert trainer.model.training and torch.equal(first, second)


def test_a_model_whose_logits_are_not_the_lm_head_output_is_refused(tmp_path):
    model = make_model(make_tokenizer())
    forward = model.forward  # stands in for softcapping or scaling inside a model's forward
    model.forward = lambda *a, **k: (lambda out: setattr(out, "logits", out.logits * 2) or out)(
        forward(*a, **k))
    with pytest.raises(ValueError, match="logits are not lm_head"):
        make_trainer(tmp_path, model=model)


# ---------------------------------------------------------------------------------------------------
# Gradient accumulation does not change the update
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_micro_batching_does_not_change_the_gradient(tmp_path, loss_type):
    whole = first_step_gradients(make_trainer(tmp_path, loss_type=loss_type, per_device_train_batch_size=8,
                                              gradient_accumulation_steps=1, beta=0.1, num_iterations=2))
    split = first_step_gradients(make_trainer(tmp_path, loss_type=loss_type, per_device_train_batch_size=2,
                                              gradient_accumulation_steps=4, beta=0.1, num_iterations=2))
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------
# It learns, and TRL PR #2899's own script runs
# ---------------------------------------------------------------------------------------------------
def test_reward_rises_over_a_short_run(tmp_path):
    rewards = []

    class Recorder(GRPOTrainer):
        def log(self, metrics):
            rewards.append(metrics["reward"])

    tokenizer = make_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=1,
                      num_generations=8, max_completion_length=8, max_steps=30, learning_rate=3e-2,
                      num_iterations=2, logging_steps=2, seed=0, save_steps=1000)
    Recorder(make_model(tokenizer), short_is_good, args, Dataset.from_dict({"prompt": PROMPTS}),
             tokenizer).train()
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.25, rewards


PR2899_SCRIPT = '''
from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer


dataset = load_dataset("trl-lib/tldr", split="train")

# Dummy reward function: the closer the completion is to 20 characters, the higher the reward
def reward_len(completions, **kwargs):
    return [-abs(100 - len(completion)) for completion in completions]

def main():
    num_iterations=4
    training_args = GRPOConfig(
        output_dir=f"Qwen2.5-0.5B-GRPO-2899-μ={num_iterations}",
        logging_steps=5,
        gradient_accumulation_steps=4,
        per_device_train_batch_size=4,
        num_generations=8,
        max_prompt_length=64,
        max_completion_length=64,
        log_completions=True,
        max_steps=200,
        num_iterations=num_iterations,
    )
    trainer = GRPOTrainer(
        model="Qwen/Qwen2.5-0.5B",
        reward_funcs=reward_len,
        args=training_args,
        train_dataset=dataset,
    )
    trainer.train()


if __name__ == "__main__":
    main()
'''


def test_trl_pr_2899_reproduction_script_runs_with_only_its_import_line_changed(tmp_path):
    """TRL PR #2899's script, verbatim but for the import line and offline stand-ins for the hub: a tiny
    local model (with its tokenizer, loaded by path) and a local JSON copy of a few tldr prompts."""
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    Dataset.from_dict({"prompt": [f"POST: {p}\nTL;DR:" for p in PROMPTS]}).to_json(tmp_path / "tldr.json")
    script = (PR2899_SCRIPT.replace("from trl import", "from grpo_multistep import")
              .replace('load_dataset("trl-lib/tldr", split="train")',
                       f'load_dataset("json", data_files="{tmp_path / "tldr.json"}", split="train")')
              .replace('"Qwen/Qwen2.5-0.5B"', f'"{tmp_path / "tiny"}"')
              .replace("max_steps=200", "max_steps=8"))
    (tmp_path / "pr2899.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(gm.__file__)), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "pr2899.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "Qwen2.5-0.5B-GRPO-2899-μ=4"
    assert (out / "model.safetensors").exists() and (out / "metrics.jsonl").read_text().count("\n") == 2
    assert "step 5" in result.stdout and "[reward" in result.stdout  # logging_steps and log_completions


# ---------------------------------------------------------------------------------------------------
# Checkpoints: resuming is bit-identical; a killed write never costs the previous checkpoint
# ---------------------------------------------------------------------------------------------------
def run_to_end(tmp_path, name, resume=None, stop_at=None, model=None, peft_config=None, **overrides):
    """Train 6 steps with μ = 3 and a checkpoint every 2 steps (so steps 2 and 4 fall inside a μ cycle);
    return the final weights and the logged metrics without the timings. `stop_at` simulates Ctrl-C.
    model: a function of the tokenizer (default: make_model)."""
    logged = []

    class Recorder(GRPOTrainer):
        def log(self, metrics):
            super().log(metrics)  # metrics.jsonl
            logged.append({k: v for k, v in metrics.items() if not k.startswith("time") and k != "elapsed"})
            if metrics["step"] == stop_at:
                raise KeyboardInterrupt

    tokenizer = make_tokenizer()
    config = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, num_generations=4, max_completion_length=12,
                  max_steps=6, num_iterations=3, save_steps=2,
                  learning_rate=1e-2, logging_steps=1, beta=0.1, seed=0)
    config.update(overrides)
    trainer = Recorder((model or make_model)(tokenizer), short_is_good, GRPOConfig(**config),
                       Dataset.from_dict({"prompt": PROMPTS}), tokenizer, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in trainer.model.parameters()], logged


def assert_same_run(a, b):
    (weights_a, metrics_a), (weights_b, metrics_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(weights_a, weights_b))
    assert metrics_a[-len(metrics_b):] == metrics_b


@pytest.mark.parametrize("checkpoint,mu,spg", [(2, 3, None), (3, 3, None), (4, 3, None), (1, 1, 6),
                                               (5, 2, 4)])
def test_resuming_from_a_checkpoint_is_bit_identical(tmp_path, checkpoint, mu, spg):
    """Inside a generation batch (μ = 3: steps 2, 4; S = 3: step 1; μ = 2, S = 2: step 5) and at its end."""
    shape = dict(num_iterations=mu, steps_per_generation=spg)
    uninterrupted = run_to_end(tmp_path, "a", save_steps=1, **shape)
    resumed = run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / f"checkpoint-{checkpoint}"), **shape)
    assert_same_run(uninterrupted, resumed)
    assert len(resumed[1]) == 6 - checkpoint


def test_ctrl_c_writes_a_checkpoint_that_resumes_bit_identically(tmp_path):
    uninterrupted = run_to_end(tmp_path, "a")
    with pytest.raises(KeyboardInterrupt):
        run_to_end(tmp_path, "b", stop_at=5)       # between the checkpoints of steps 4 and 6
    assert os.path.isdir(tmp_path / "b" / "checkpoint-5")
    assert_same_run(uninterrupted, run_to_end(tmp_path, "b", resume=True))  # True: the newest in output_dir
    elapsed = [json.loads(line)["elapsed"] for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert len(elapsed) == 6 and elapsed == sorted(elapsed)  # the clock goes on across the resume


KILLED_WHILE_SAVING = """
import sys, time, torch
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
real_save = torch.save
def save(obj, path, *a, **k):
    if isinstance(obj, dict) and obj.get("step") == 4:  # the model is written, trainer state not yet
        open({flag!r}, "w").close()
        time.sleep(600)
    real_save(obj, path, *a, **k)
torch.save = save
t.run_to_end(Path({tmp!r}), "run")
"""


def test_a_process_killed_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path):
    flag = tmp_path / "saving"
    script = KILLED_WHILE_SAVING.format(here=os.path.dirname(os.path.abspath(__file__)), flag=str(flag),
                                        tmp=str(tmp_path))
    with child_at(flag, script):  # killed at the checkpoint of step 4
        pass
    run = tmp_path / "run"
    # half-written: .tmp
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4.tmp", "metrics.jsonl"]
    assert gm.list_checkpoints(str(run)) == [str(run / "checkpoint-2")]
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4]  # steps 3, 4: done, but not checkpointed
    assert_same_run(run_to_end(tmp_path, "a"), run_to_end(tmp_path, "run", resume=True))
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4, 5, 6]  # each step once


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    run_to_end(tmp_path, "a", save_steps=1, save_total_limit=2)
    assert ([os.path.basename(c) for c in gm.list_checkpoints(str(tmp_path / "a"))]
            == ["checkpoint-5", "checkpoint-6"])


def test_rolling_back_to_an_older_checkpoint_sets_the_later_work_aside_and_resumes_exactly(tmp_path):
    """Resuming checkpoint-1 of a run that reached checkpoint-2 (going back to a good point) runs like a run
    that never stopped. checkpoint-2, the final model and the metrics after step 1 are moved aside, named in
    a warning, never deleted: no later resume_from_checkpoint=True or save_total_limit can pick them."""
    uninterrupted = run_to_end(tmp_path, "whole")
    run_to_end(tmp_path, "a", max_steps=2, save_steps=1)
    with pytest.warns(UserWarning, match="rolling back to step 1: checkpoint-2") as warned:
        rolled_back = run_to_end(tmp_path, "a", resume=str(tmp_path / "a" / "checkpoint-1"), save_steps=1,
                                 save_total_limit=2)
    assert_same_run(uninterrupted, rolled_back)
    aside = tmp_path / "a" / next(n for n in os.listdir(tmp_path / "a") if n.startswith("rolled-back-to-1-"))
    assert any(str(aside) in str(w.message) for w in warned)
    assert sorted(os.listdir(aside)) == ["chat_template.jinja", "checkpoint-2", "config.json",
                                         "final_model_files.json", "generation_config.json", "metrics.jsonl",
                                         "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert [r["step"] for r in metrics_of(aside)] == [2]
    assert [r["step"] for r in metrics_of(tmp_path / "a")] == [1, 2, 3, 4, 5, 6]
    assert checkpoints(tmp_path / "a") == ["checkpoint-5", "checkpoint-6"]


def test_resume_rejects_a_folder_that_is_not_a_checkpoint_or_has_another_batch_shape(tmp_path):
    run_to_end(tmp_path, "a")
    with pytest.raises(ValueError, match="is not a checkpoint: no trainer_state.pt"):
        run_to_end(tmp_path, "b", resume=str(tmp_path))
    with pytest.raises(ValueError, match=r"different batch shape.*'num_iterations': \(3, 2\)"):
        run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-2"), num_iterations=2)
    with pytest.raises(ValueError, match="holds no checkpoint"):
        run_to_end(tmp_path, "empty", resume=True)


# ---------------------------------------------------------------------------------------------------
# A non-finite loss never reaches the weights
# ---------------------------------------------------------------------------------------------------
def test_a_non_finite_loss_skips_the_step_and_leaves_weights_and_optimizer_untouched(tmp_path, monkeypatch):
    loss = gm.grpo_loss
    monkeypatch.setattr(gm, "grpo_loss", lambda *a: (lambda l, s: (l * float("nan"), s))(*loss(*a)))
    trainer = make_trainer(tmp_path)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.batch, _ = trainer.generate_and_score(0)
    with pytest.warns(UserWarning, match="non-finite loss or gradient norm"):
        metrics = trainer.optimizer_step(trainer.batch)
    assert metrics["nonfinite_steps"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.optimizer.state_dict()["state"] == {} and trainer.scheduler.last_epoch == 0


def test_three_non_finite_steps_in_a_row_stop_training_with_a_checkpoint(tmp_path, monkeypatch):
    loss = gm.grpo_loss
    monkeypatch.setattr(gm, "grpo_loss", lambda *a: (lambda l, s: (l * float("inf"), s))(*loss(*a)))
    trainer = make_trainer(tmp_path, max_steps=10)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError,
                                                  match="3 optimizer steps in a row had a non-finite"):
        trainer.train()
    assert gm.list_checkpoints(trainer.args.output_dir)[-1].endswith("checkpoint-3")


# ---------------------------------------------------------------------------------------------------
# Data parallelism: N processes make the same optimizer steps as one process over the same completions
# ---------------------------------------------------------------------------------------------------
def fixed_completions(model, tokenizer, prompt_ids, prompt_mask, args, eos_token_ids=None):
    """Stands in for generate_completions: completions (and their lengths) that depend only on the
    prompt, so that any split of the prompts over ranks yields the same global batch."""
    G, C = args.num_generations, args.max_completion_length
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0)
    key = (prompt_ids * prompt_mask).sum(1)                                   # one number per prompt
    j = torch.arange(len(key)) % G                                            # sample index in the group
    completion_ids = (key[:, None] * 7 + j[:, None] * 31 + torch.arange(C) * 13) % 250 + 2
    length = (key + 3 * j) % C + 1                                            # varied lengths
    completion_ids[torch.arange(len(key)), length - 1] = tokenizer.eos_token_id
    return prompt_ids, prompt_mask, completion_ids, completion_mask(completion_ids, tokenizer.eos_token_id)


DATA_PARALLEL_RUNS = [(loss_type, mu, S) for loss_type in ("grpo", "dapo", "dr_grpo") for mu in (1, 2)
                      for S in (1, 2) if S == 1 or mu == 1 and loss_type != "dr_grpo"]


def train_on_fixed_completions(tmp_path, world_size):
    """Two optimizer steps of each (loss_type, μ, S), 16 completions per step over all ranks."""
    gm.generate_completions = fixed_completions
    params = {}
    for loss_type, mu, S in DATA_PARALLEL_RUNS:
        trainer = make_trainer(tmp_path, loss_type=loss_type, num_iterations=mu, beta=0.1,
                               per_device_train_batch_size=8 // world_size, gradient_accumulation_steps=2,
                               steps_per_generation=2 * S, max_steps=2, save_steps=100,
                               output_dir=str(tmp_path / f"{loss_type}-{mu}-{S}"))
        trainer.log = lambda metrics: None
        grads = []  # the gradients each optimizer step applies, after the all-reduce
        trainer.optimizer.register_step_pre_hook(
            lambda *_: grads.append([p.grad.clone() for p in trainer.model.parameters()]))
        trainer.train()
        params[loss_type, mu, S] = grads, [p.detach().clone() for p in trainer.model.parameters()]
    return params


def data_parallel_worker(rank, world_size, port, tmp_path):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    params = train_on_fixed_completions(tmp_path, world_size)
    if rank == 0:
        torch.save(params, tmp_path / "params.pt")
    torch.distributed.destroy_process_group()


def test_two_processes_make_the_same_updates_as_one(tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "generate_completions", fixed_completions)
    single = train_on_fixed_completions(tmp_path / "single", world_size=1)
    with socket.socket() as s:  # a free port for the gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(data_parallel_worker, args=(2, port, tmp_path), nprocs=2)
    double = torch.load(tmp_path / "params.pt")
    for run in DATA_PARALLEL_RUNS:
        (grads_1, params_1), (grads_2, params_2) = single[run], double[run]
        assert len(grads_1) == len(grads_2) == 2
        for step_1, step_2 in zip(grads_1, grads_2):  # the same gradient, scale included, up to float noise
            for a, b in zip(step_1, step_2):  # (the second step's weights differ in the last bits: atol)
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{run}")
        # Then the same weights, up to Adam's amplification of float noise in near-zero gradients
        # (learning rate 1e-2: the weights move by about 2e-2).
        for a, b in zip(params_1, params_2):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"{run}")


# ---------------------------------------------------------------------------------------------------
# Bad input fails fast, with a message that names the problem
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,match", [
    ("num_generations", 1, "num_generations=1"),
    ("num_iterations", 0, "num_iterations=0"),
    ("epsilon", 0.0, "epsilon=0.0"),
    ("epsilon", 1.5, "epsilon=1.5"),
    ("temperature", 0.0, "temperature=0.0"),
    ("max_completion_length", 0, "max_completion_length=0"),
    ("logging_steps", 0, "logging_steps=0"),
    ("save_steps", 0, "save_steps=0"),
    ("loss_type", "ppo", "loss_type='ppo'"),
    ("scale_rewards", "batch", "scale_rewards='batch'"),
    ("importance_sampling_level", "sequences", "importance_sampling_level='sequences'"),
])
def test_bad_config_values_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{field: value})


def test_bad_trainer_inputs_are_rejected_before_training(tmp_path):
    with pytest.raises(ValueError, match="not divisible by num_generations=4"):
        make_trainer(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="empty"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"text": PROMPTS}))
    with pytest.raises(ValueError, match="prompt 1 is an empty string"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": ["hi", " "]}))
    with pytest.raises(ValueError, match="reward_weights has 2 weights for 1 reward functions"):
        make_trainer(tmp_path, reward_weights=[1.0, 2.0])


def test_a_model_that_cannot_be_loaded_is_named_within_seconds(tmp_path):
    start = time.perf_counter()
    with pytest.raises(ValueError, match="could not load '.*no-such-folder'"):
        GRPOTrainer(str(tmp_path / "no-such-folder"), short_is_good, GRPOConfig(),
                    Dataset.from_dict({"prompt": PROMPTS}))
    with pytest.raises(ValueError, match="could not load 'no-such-user/no-such-model-for-grpo'"):
        GRPOTrainer("no-such-user/no-such-model-for-grpo", short_is_good, GRPOConfig(),
                    Dataset.from_dict({"prompt": PROMPTS}))
    assert time.perf_counter() - start < 20


def test_the_hub_counts_as_reachable_when_it_answers_at_all(monkeypatch):
    """One HTTP request, through a proxy if one is set: any status is an answer (the hub is there), no answer
    within seconds means offline, so that loading looks in the local cache instead of retrying for 30 s."""
    import http.server, threading
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(404)
            self.end_headers()
        def log_message(self, *args):
            pass
    server = http.server.HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    # huggingface_hub read HF_HUB_OFFLINE when it was imported: a shell that exports it (offline users do)
    # set its client offline before this test began
    monkeypatch.setattr(gm.huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    try:
        monkeypatch.setattr(gm.huggingface_hub.constants, "ENDPOINT",
                            f"http://127.0.0.1:{server.server_port}")
        assert gm.hub_reachable()
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as closed:  # a port that nothing listens on
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(gm.huggingface_hub.constants, "ENDPOINT",
                            f"http://127.0.0.1:{closed.getsockname()[1]}")
        assert not gm.hub_reachable()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not gm.hub_reachable()


def test_a_tokenizer_without_eos_is_rejected(tmp_path):
    tokenizer = make_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token"):
        make_trainer(tmp_path, tokenizer=tokenizer)


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """With activations recomputed, per_token_logps takes its one-pass path (no shared prompt cache)."""
    plain, checkpointed = (first_step_gradients(make_trainer(tmp_path / str(gc), num_iterations=2, beta=0.1,
                                                             gradient_checkpointing=gc))
                           for gc in (False, True))
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_a_model_built_in_memory_needs_its_tokenizer_passed(tmp_path):
    """Such a model names no tokenizer to load: say what to pass, not that '' is missing from the hub."""
    with pytest.raises(ValueError, match="processing_class"):
        GRPOTrainer(make_model(make_tokenizer()), short_is_good, GRPOConfig(output_dir=str(tmp_path)),
                    Dataset.from_dict({"prompt": PROMPTS}))


@pytest.mark.parametrize("kind", ["qwen2", "gemma"])
def test_a_model_folder_without_tokenizer_files_says_so(tmp_path, kind):
    """Its model type's tokenizer class loads with special tokens only: every prompt would render to 0 tokens
    (Qwen2's) or to <unk>s (Gemma's). Named at construction instead, with what to pass."""
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = (Qwen2ForCausalLM(Qwen2Config(**sizes)) if kind == "qwen2"
             else GemmaForCausalLM(GemmaConfig(**sizes)))
    model.save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match=r"special tokens only .*model'\): pass processing_class"):
        GRPOTrainer(str(tmp_path / "model"), short_is_good, GRPOConfig(output_dir=str(tmp_path / "out")),
                    Dataset.from_dict({"prompt": PROMPTS}))


def test_prompt_and_completion_past_a_learned_position_table_are_refused_at_the_start(tmp_path):
    """GPT-2 learns one embedding per position: past its table, an IndexError deep in torch mid-run. A config
    that could go past it is refused when train() starts; one that fits trains; a rotary model (no table)
    runs past max_position_embeddings as before."""
    tokenizer = make_tokenizer()
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=20, n_embd=32, n_layer=1,
                                      n_head=2, eos_token_id=tokenizer.eos_token_id, bos_token_id=None))
    long_prompts = Dataset.from_dict({"prompt": ["the cat sat on the mat " * 2] * 8})  # > 16 tokens each
    for prompt_length, match in ((16, "=16 \\+ max_completion_length=12 exceed the model's table of 20 "
                                      "positions.*sum <= 20"),
                                 (None, "max_prompt_length=None")):
        with pytest.raises(ValueError, match=match):
            make_trainer(tmp_path, model=gpt2, tokenizer=tokenizer, dataset=long_prompts,
                         max_prompt_length=prompt_length).train()
    make_trainer(tmp_path, model=gpt2, tokenizer=tokenizer, max_prompt_length=8, max_steps=1).train()
    rotary = make_model(tokenizer)
    rotary.config.max_position_embeddings = 16
    make_trainer(tmp_path / "rotary", model=rotary, tokenizer=tokenizer, max_steps=1).train()


def test_prompts_as_a_list_of_rows_are_checked_like_a_dataset(tmp_path):
    trainer = make_trainer(tmp_path, dataset=[{"prompt": p, "answer": p} for p in PROMPTS])
    assert trainer.dataset.column_names == ["prompt", "answer"]
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"mixes plain text and conversations \(prompt 1\)"):
        make_trainer(tmp_path, dataset=[{"prompt": "hi"}, {"prompt": conversation}])
    with pytest.raises(ValueError, match="prompt 0 is neither text nor a conversation"):
        make_trainer(tmp_path, dataset=[{"prompt": 42}])
    with pytest.raises(ValueError, match="keys of its first row"):  # a list's later keys would be dropped
        make_trainer(tmp_path, dataset=[{"prompt": "hi"}, {"prompt": "ho", "answer": "x"}])


def broken(completions, **kw):
    raise KeyError("answer")


def too_few(completions, **kw):
    return [1.0]


def not_numbers(completions, **kw):
    return ["good"] * len(completions)


def never_applies(completions, **kw):
    return [None] * len(completions)


def nan_reward(completions, **kw):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize("func,error,match", [
    (broken, RuntimeError, "reward function 'broken' raised KeyError"),
    (too_few, ValueError, "reward function 'too_few' returned 1 values for 8 completions"),
    (not_numbers, TypeError, "reward function 'not_numbers' returned 'good'"),
    (never_applies, ValueError, "every reward function returned None for completion 0"),
    (nan_reward, ValueError, "reward function 'nan_reward' returned nan for completion 0"),
])
def test_bad_reward_functions_are_named(tmp_path, func, error, match):
    trainer = make_trainer(tmp_path, reward_funcs=func)
    with pytest.raises(error, match=match):
        trainer.train()


# ---------------------------------------------------------------------------------------------------
# Reliability: nothing lost, nothing run
# ---------------------------------------------------------------------------------------------------
def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    """Resuming unpickles only tensors and plain data: a trainer_state.pt that would run code is refused."""
    make_trainer(tmp_path, save_steps=1).train()
    state_file, marker = tmp_path / "out" / "checkpoint-1" / "trainer_state.pt", tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):  # unpickling this object calls exec(...)
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))
    torch.save({**torch.load(state_file, weights_only=False), "note": RunsCode()}, state_file)
    with pytest.raises(ValueError, match="trainer_state.pt"):
        make_trainer(tmp_path, save_steps=1).train(resume_from_checkpoint=str(state_file.parent))
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated"])
@pytest.mark.parametrize("name", ["trainer_state.pt", "model.safetensors"])
def test_an_empty_or_truncated_checkpoint_file_is_named_corrupt(tmp_path, damage, name):
    """A checkpoint file cut short (a full disk, a broken copy) is named, with its path, as corrupt."""
    make_trainer(tmp_path, save_steps=1).train()
    damaged = tmp_path / "out" / "checkpoint-1" / name
    data = damaged.read_bytes()
    damaged.write_bytes(b"" if damage == "empty" else data[:len(data) // 2])
    with pytest.raises(ValueError, match=re.escape(str(damaged)) + ".*corrupt"):
        make_trainer(tmp_path, save_steps=1).train(resume_from_checkpoint=str(damaged.parent))


def metrics_of(out):
    """metrics.jsonl without the timings: what a resumed run must log exactly like an uninterrupted one."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "elapsed"} for r in rows]


def checkpoints(out):
    return [os.path.basename(c) for c in gm.list_checkpoints(str(out))]


def assert_resumes_like_a_run_that_never_stopped(tmp_path, reward=short_is_good):
    """Finish tmp_path/out's 4-step run from its checkpoint-2; compare with a run that never stopped."""
    resumed, whole = (make_trainer(tmp_path, reward, max_steps=4, save_steps=100,
                                   output_dir=str(tmp_path / d)) for d in ("out", "whole"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    whole.train()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))
    assert metrics_of(tmp_path / "out") == metrics_of(tmp_path / "whole")


@pytest.mark.parametrize("failure,error", [("raises", RuntimeError), ("nan", ValueError)])
def test_a_failing_reward_function_keeps_the_finished_steps(tmp_path, failure, error):
    """A reward failing in step 3 leaves checkpoint-2, which resumes exactly like a run that never failed."""
    calls = []
    def flaky_reward(completion_ids, **kw):  # short_is_good, but its 3rd call raises or returns NaN
        calls.append(1)
        if len(calls) == 3 and failure == "raises":
            raise ConnectionError("the grader is down")
        return [math.nan] * len(completion_ids) if len(calls) == 3 else short_is_good(completion_ids)
    with pytest.raises(error, match="flaky_reward"):
        make_trainer(tmp_path, flaky_reward, max_steps=4, save_steps=100).train()
    assert "checkpoint-2" in checkpoints(tmp_path / "out")
    assert_resumes_like_a_run_that_never_stopped(tmp_path, flaky_reward)  # its 3rd call is past: it works now


A_60_S_CALL_IN_STEP_3 = """
import functools, os, sys, time
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t, grpo_multistep as gm
generate, calls = gm.generate_completions, []
def slow(function):  # its 3rd call (step 3) takes 60 s: a long generation, an LLM judge
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            open({flag!r}, "w").close()
            time.sleep(60)
        return function(*args, **kwargs)
    return wrapped
if {phase!r} == "generate":
    gm.generate_completions = slow(generate)
t.make_trainer(Path({tmp!r}), slow(t.short_is_good) if {phase!r} == "reward" else t.short_is_good,
               max_steps=4, save_steps=100).train()
"""


@contextlib.contextmanager
def child_at(flag, script=None, env=None, command=None):
    """A child process running `script` (or `command`), once it has made `flag`; killed at the block's end."""
    process = subprocess.Popen(command or [sys.executable, "-c", script],
                               env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    try:
        for _ in range(1200):
            if flag.exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert flag.exists(), f"the child never reached its flag (exit status {process.poll()})"
        yield process
    finally:
        process.kill()
        process.wait()


def run_until(script, flag, signum, env=None, command=None):
    """Run `script` in a child process, send it `signum` once `flag` exists; its exit status and the seconds
    from the signal to its exit."""
    with child_at(flag, script, env, command) as process:
        sent = time.monotonic()
        process.send_signal(signum)
        return process.wait(timeout=60), time.monotonic() - sent


@pytest.mark.parametrize("phase,signum,status", [("generate", signal.SIGTERM, 143),
                                                 ("reward", signal.SIGTERM, 143),
                                                 ("reward", signal.SIGHUP, 129),
                                                 ("reward", signal.SIGUSR1, 138),
                                                 ("reward", signal.SIGQUIT, 131)])
def test_a_signal_stops_a_60_s_step_within_seconds_keeping_the_finished_steps(tmp_path, phase, signum,
                                                                              status):
    """SIGTERM (preemption: SLURM and Kubernetes send SIGKILL about 30 s later), SIGHUP (a lost ssh
    connection), SIGUSR1 (SLURM's --signal=USR1@<seconds>: checkpoint before the time limit) or SIGQUIT
    (Ctrl-\\) during step 3's 60 s generation or reward call: that step is abandoned, checkpoint-2 is
    written, and the process exits with status 128 + the signal within seconds. The checkpoint resumes
    bit-identically."""
    flag = tmp_path / "slow"
    script = A_60_S_CALL_IN_STEP_3.format(here=os.path.dirname(os.path.abspath(__file__)), flag=str(flag),
                                          tmp=str(tmp_path), phase=phase)
    code, seconds = run_until(script, flag, signum)
    assert code == status and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert_resumes_like_a_run_that_never_stopped(tmp_path)


A_SLOW_FINAL_SAVE = """
import sys, time, torch
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
save = torch.save
def slow_save(obj, path, *args, **kwargs):
    if isinstance(obj, dict) and obj.get("step") == 4:  # the final checkpoint: the model is written already
        open({flag!r}, "w").close()
        time.sleep(3)
    save(obj, path, *args, **kwargs)
torch.save = slow_save
t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100).train()
"""


def test_a_signal_during_the_final_save_waits_for_the_checkpoint_and_the_model(tmp_path):
    """SIGTERM while the final checkpoint is written: it and the final model are completed, then exit 143."""
    flag = tmp_path / "saving"
    script = A_SLOW_FINAL_SAVE.format(here=os.path.dirname(os.path.abspath(__file__)), flag=str(flag),
                                      tmp=str(tmp_path))
    code, seconds = run_until(script, flag, signal.SIGTERM)
    assert code == 143 and seconds < 20, (code, seconds)
    out = tmp_path / "out"
    assert checkpoints(out) == ["checkpoint-4"] and not os.path.exists(out / "checkpoint-4.tmp")
    assert torch.load(out / "checkpoint-4" / "trainer_state.pt", weights_only=True)["step"] == 4
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


ONE_RANK_FAILS = """
import os, sys
from pathlib import Path
sys.path[:0] = [{here!r}]
os.environ.update(RANK=sys.argv[1], LOCAL_RANK=sys.argv[1], WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="{port}")
import test_grpo_multistep as t
calls = []
def reward(completion_ids, **kw):
    calls.append(1)
    if sys.argv[1] == "0" and len(calls) == 2:  # only rank 0 fails, in step 2
        raise ConnectionError("the grader is down")
    return t.short_is_good(completion_ids)
t.make_trainer(Path({tmp!r}), reward, max_steps=4, save_steps=100).train()
"""


SIGTERM_DURING_THE_UPDATE_OF_STEP_3 = """
import os, signal, sys
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
trainer = t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100)
updates = []
def preempted(optimizer, args, kwargs):  # runs inside optimizer.step(): the weights are being updated
    updates.append(1)
    if len(updates) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
trainer.optimizer.register_step_post_hook(preempted)
trainer.train()
"""


def test_a_signal_during_the_weight_update_waits_for_the_step_to_end(tmp_path):
    """SIGTERM inside step 3's update does not checkpoint half a step: step 3 ends, checkpoint-3 holds it."""
    script = SIGTERM_DURING_THE_UPDATE_OF_STEP_3.format(here=os.path.dirname(os.path.abspath(__file__)),
                                                        tmp=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode in (143, -signal.SIGTERM), result.stderr[-3000:]
    assert checkpoints(tmp_path / "out") == ["checkpoint-3"]
    resumed, whole = (make_trainer(tmp_path, max_steps=4, save_steps=100, output_dir=str(tmp_path / d))
                      for d in ("out", "whole"))
    resumed.train(resume_from_checkpoint=True)
    whole.train()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


def test_train_again_on_the_same_trainer_after_ctrl_c_resumes_exactly(tmp_path, monkeypatch):
    """Ctrl-C between the two backward passes of step 3 leaves half a gradient in .grad (the notebook case):
    train(resume_from_checkpoint=True) on the same trainer object must not add it into the resumed step."""
    loss, calls = gm.grpo_loss, []
    def interrupted(*args):  # micro-batches 1-2 are step 1, 3-4 step 2, 5-6 step 3
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return loss(*args)
    monkeypatch.setattr(gm, "grpo_loss", interrupted)
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=100)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert any(p.grad is not None for p in trainer.model.parameters())  # what the interruption left
    monkeypatch.setattr(gm, "grpo_loss", loss)
    trainer.train(resume_from_checkpoint=True)
    whole = make_trainer(tmp_path, max_steps=4, save_steps=100, output_dir=str(tmp_path / "whole")).train()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), trainer.model.parameters()))
    assert metrics_of(tmp_path / "out") == metrics_of(tmp_path / "whole")


def test_train_outside_the_main_thread_runs_without_signal_handlers(tmp_path):
    """Only the main thread can set signal handlers: elsewhere train() sets none, and runs
    (docs/checkpoints.md says that a signal then ends it without a checkpoint)."""
    trainer, handler = make_trainer(tmp_path), signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=trainer.train)
    thread.start()
    thread.join()
    assert trainer.step == 2 and signal.getsignal(signal.SIGTERM) is handler


def test_a_signal_during_a_periodic_save_stops_after_it_not_a_step_later(tmp_path, monkeypatch):
    """The save comes before the end of step 2's check for signals, so the run stops at step 2, saved once."""
    save, saves = torch.save, []
    def interrupted(obj, *args, **kwargs):
        saves.append(obj["step"])
        save(obj, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)  # as the checkpoint of step 2 is being written
    monkeypatch.setattr(torch, "save", interrupted)
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert (trainer.step, saves, checkpoints(tmp_path / "out")) == (2, [2], ["checkpoint-2"])


def test_a_signal_during_a_log_override_waits_for_it_so_that_the_saved_step_is_logged(tmp_path):
    """SIGTERM while a log() override uploads step 2's metrics (a tracker) before writing them: the step is
    logged, then checkpointed, then the run exits; its resume logs steps 3 and 4: every step once."""
    class Uploading(GRPOTrainer):
        def log(self, metrics):
            if metrics["step"] == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # during the upload
            super().log(metrics)
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=100)
    trainer.__class__ = Uploading
    with pytest.raises(SystemExit):
        trainer.train()
    assert ([r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2]
            and checkpoints(tmp_path / "out") == ["checkpoint-2"])
    make_trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=True)
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3, 4]


def test_a_resume_after_a_skipped_step_keeps_the_learning_rate_schedule(tmp_path, monkeypatch):
    """A non-finite step does not advance the learning-rate schedule; nor does it in a resumed run."""
    loss, calls = gm.grpo_loss, []

    def non_finite_in_step_1(*args):  # the first step's two micro-batches
        calls.append(1)
        value, stats = loss(*args)
        return (value * math.nan if len(calls) <= 2 else value), stats
    monkeypatch.setattr(gm, "grpo_loss", non_finite_in_step_1)
    with pytest.warns(UserWarning, match="non-finite"):
        whole = make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    resumed = make_trainer(tmp_path, max_steps=3, output_dir=str(tmp_path / "b"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert resumed.scheduler.get_last_lr() == whole.scheduler.get_last_lr() == [1e-2 * (1 - 2 / 3)]
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


def test_inside_a_mu_cycle_a_resume_with_what_made_the_cached_batch_changed_is_refused(tmp_path):
    """The cached generation batch holds π_old's log-probs at the old temperature (and π_ref's, or none), and
    advantages made with the old reward weights and scaling."""
    make_trainer(tmp_path, num_iterations=2, max_steps=2, save_steps=1).train()
    for change in ({"temperature": 0.5}, {"beta": 0.1}, {"scale_rewards": "none"}, {"reward_weights": [2.0]}):
        with pytest.raises(ValueError, match=list(change)[0]):
            make_trainer(tmp_path, num_iterations=2, max_steps=2, output_dir=str(tmp_path / "b"),
                         **change).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))


def two_ranks(template, tmp_path):
    """Two processes running `template` as ranks 0 and 1 of one gloo process group (a free port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = template.format(here=os.path.dirname(os.path.abspath(__file__)), port=port, tmp=str(tmp_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-c", script, str(rank)], env=env) for rank in (0, 1)]


def test_a_failure_on_one_rank_ends_every_rank_and_keeps_the_finished_steps(tmp_path):
    """Under torchrun, an error on one rank ends every rank (none waits in a collective) with a checkpoint."""
    ranks = two_ranks(ONE_RANK_FAILS, tmp_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and None in [p.poll() for p in ranks]:
        time.sleep(0.5)
    codes = [p.poll() for p in ranks]
    for p in ranks:
        p.kill()
        p.wait()
    assert None not in codes, f"a rank still runs 120 s after rank 0's error (exit codes {codes})"
    assert 0 not in codes, f"the failed run must end in an error on every rank (exit codes {codes})"
    assert "checkpoint-1" in checkpoints(tmp_path / "out")


TORCHRUN_WORKER = """
import os, sys, time
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
calls = []
def reward(completion_ids, **kw):  # rank 1's grader hangs for 60 s in step 3 of the first run
    calls.append(1)
    if sys.argv[1] == "slow" and os.environ["RANK"] == "1" and len(calls) == 3:
        open({flag!r}, "w").close()
        time.sleep(60)
    return t.short_is_good(completion_ids)
trainer = t.make_trainer(Path({tmp!r}), reward, max_steps=4, save_steps=100, per_device_train_batch_size=4,
                         gradient_accumulation_steps=1, output_dir=sys.argv[2])
trainer.train(resume_from_checkpoint=sys.argv[3] == "resume")
t.torch.distributed.destroy_process_group()  # else a gloo thread can abort the exit (SIGABRT), now and then
"""


def test_sigterm_to_torchrun_stops_every_rank_within_seconds_with_a_checkpoint(tmp_path):
    """torchrun forwards SIGTERM to its workers and SIGKILLs them 30 s later. With rank 1 inside a 60 s reward
    call of step 3 (rank 0 waiting for it in a collective), both stop within seconds; rank 0 checkpoints step
    2 from its snapshot (no collective left unmatched), and the checkpoint resumes bit-identically."""
    worker, flag = tmp_path / "worker.py", tmp_path / "slow"
    worker.write_text(TORCHRUN_WORKER.format(here=os.path.dirname(os.path.abspath(__file__)), flag=str(flag),
                                             tmp=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(worker)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code, seconds = run_until(None, flag, signal.SIGTERM,
                              command=[*torchrun, "slow", str(tmp_path / "out"), "new"])
    assert code != 0 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    for args in (["fast", str(tmp_path / "out"), "resume"], ["fast", str(tmp_path / "whole"), "new"]):
        done = subprocess.run([*torchrun, *args], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-5000:]
    weights = [gm.AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("out", "whole")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert metrics_of(tmp_path / "out") == metrics_of(tmp_path / "whole")


def test_a_new_run_does_not_overwrite_another_runs_work(tmp_path):
    """A fresh run into a used output_dir stops, unless overwrite_output_dir=True: then nothing of the
    old run is left to be mistaken for the new one's (its checkpoints, its metrics)."""
    make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    with pytest.raises(ValueError, match="overwrite_output_dir"):
        make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    assert os.path.isdir(tmp_path / "out" / "checkpoint-3")
    def fails_in_step_2(completion_ids, **kw):
        fails_in_step_2.calls = getattr(fails_in_step_2, "calls", 0) + 1
        assert fails_in_step_2.calls < 2, "the grader is down"
        return short_is_good(completion_ids)
    with pytest.raises(RuntimeError, match="the grader is down"):
        make_trainer(tmp_path, fails_in_step_2, max_steps=3, save_steps=1, overwrite_output_dir=True).train()
    # Nothing of the old run is left (its final model included) beside the new run's checkpoint-1.
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-1", "metrics.jsonl"]
    assert [m["step"] for m in metrics_of(tmp_path / "out")] == [1]


def test_resuming_into_an_output_dir_that_holds_another_run_is_refused(tmp_path):
    """Resuming run a's checkpoint with output_dir b, where run b lies, would delete b's checkpoints
    (save_total_limit), overwrite its model and mix the metrics: refused as a fresh run is."""
    run_to_end(tmp_path, "a")
    run_to_end(tmp_path, "b")
    before = sorted(os.listdir(tmp_path / "b"))
    with pytest.raises(ValueError, match="holds another run.*overwrite_output_dir"):
        run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-4"))
    assert sorted(os.listdir(tmp_path / "b")) == before
    run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-4"), overwrite_output_dir=True)
    assert ([r["step"] for r in metrics_of(tmp_path / "b")] == [5, 6]
            and checkpoints(tmp_path / "b") == ["checkpoint-6"])


def test_an_output_dir_that_is_the_models_own_folder_is_refused(tmp_path):
    """The final model (and checkpoints) would overwrite the base model in place."""
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(tmp_path / "model")
    trainer = make_trainer(tmp_path, model=str(tmp_path / "model"), tokenizer=tokenizer,
                           output_dir=str(tmp_path / "model"))
    with pytest.raises(ValueError, match="model's own folder"):
        trainer.train()


def test_the_config_is_checked_again_when_train_starts(tmp_path):
    """Fields changed after the trainer was made: checked like new ones, or named if they cannot apply."""
    trainer = make_trainer(tmp_path)
    trainer.args.num_generations = 1
    with pytest.raises(ValueError, match="num_generations=1"):
        trainer.train()
    trainer.args.num_generations, trainer.args.beta = 4, 0.1
    with pytest.raises(ValueError, match="no reference model"):
        trainer.train()
    trainer.args.beta, trainer.args.epsilon = 0.0, 0.05  # epsilon_high=None follows ε to the new value
    clipped = gm.grpo_loss(torch.log(torch.tensor([[1.1]])), torch.zeros(1, 1), None, torch.ones(1),
                           torch.ones(1, 1), trainer.args, 1, 1)[1]["clip_high"]
    assert trainer.args.epsilon_high is None and clipped == 1


def test_a_checkpoint_is_written_once_and_never_replaced(tmp_path, monkeypatch):
    """Resuming checkpoint-2 at max_steps=2, or a failure right after resuming it, never writes it again:
    replacing a complete checkpoint would put it at risk for nothing."""
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    state = tmp_path / "out" / "checkpoint-2" / "trainer_state.pt"
    before = state.stat().st_mtime_ns
    saves = []
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: saves.append(args[1]))
    with pytest.warns(UserWarning, match="nothing is left to train"):
        make_trainer(tmp_path, max_steps=2, save_steps=1).train(resume_from_checkpoint=True)
    assert saves == [] and state.stat().st_mtime_ns == before
    assert (tmp_path / "out" / "model.safetensors").exists()  # the final model is written again


def test_a_resume_says_what_it_changes(tmp_path):
    """A new learning rate replaces the checkpoint's, with a warning; a max_steps already reached warns."""
    run = dict(lr_scheduler_type="constant", save_steps=1)
    make_trainer(tmp_path, learning_rate=1e-2, max_steps=2, **run).train()
    trainer = make_trainer(tmp_path, learning_rate=1e-5, max_steps=3, **run)
    with pytest.warns(UserWarning, match="learning_rate"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-5
    with pytest.warns(UserWarning, match="max_steps"):  # nothing left to train
        make_trainer(tmp_path, learning_rate=1e-2, max_steps=2, **run).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))


# ---------------------------------------------------------------------------------------------------
# output_dir: one run at a time, and only the run's own files are ever deleted or moved
# ---------------------------------------------------------------------------------------------------
USERS_FILES = ["tokenizer_experiments/", "tokenizer_v2.py", "vocab.json", "model_v1.safetensors.d/",
               "notes.txt"]


def put_users_files(out):
    os.makedirs(out, exist_ok=True)
    for name in USERS_FILES:
        os.makedirs(out / name) if name.endswith("/") else (out / name).write_text("the user's")


def test_overwrite_and_roll_back_touch_only_what_the_run_wrote_and_name_it(tmp_path):
    """Files of the user's beside a run, named like a model's or a tokenizer's, are never deleted or moved:
    the run lists its final model's files, and overwrite and roll back go by that list."""
    out = tmp_path / "out"
    put_users_files(out)
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    with pytest.warns(UserWarning, match="rolling back to step 1: checkpoint-2, .*model.safetensors"):
        make_trainer(tmp_path, max_steps=2, save_steps=1).train(
            resume_from_checkpoint=str(out / "checkpoint-1"))
    with pytest.warns(UserWarning, match=r"overwrite_output_dir deletes checkpoint-1, checkpoint-2, "
                                         r"metrics.jsonl, .*model.safetensors"):
        make_trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert all(os.path.exists(out / name) for name in USERS_FILES)
    assert (out / "vocab.json").read_text() == "the user's"
    listed = json.loads((out / "final_model_files.json").read_text())
    assert (sorted(n for n in os.listdir(out) if not n.startswith("rolled-back-to-"))
            == sorted(["checkpoint-1", "metrics.jsonl", "final_model_files.json", *listed,
                       *(name.rstrip("/") for name in USERS_FILES)]))


def test_a_resume_path_that_is_no_checkpoint_folder_deletes_nothing_even_with_overwrite(tmp_path):
    """resume_from_checkpoint naming a file (trainer_state.pt) or output_dir itself, with
    overwrite_output_dir: the checkpoint is inside output_dir, so nothing there is another run's to delete;
    the path is refused."""
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    before = sorted(os.listdir(tmp_path / "out"))
    for path in (tmp_path / "out" / "checkpoint-2" / "trainer_state.pt", tmp_path / "out"):
        with pytest.raises(ValueError, match="is not a checkpoint"):
            make_trainer(tmp_path, max_steps=3, overwrite_output_dir=True).train(
                resume_from_checkpoint=str(path))
        assert sorted(os.listdir(tmp_path / "out")) == before


@pytest.mark.parametrize("listed", ['["..", "../outside", "."]', '["config.json", "mod'])
def test_a_tampered_or_cut_final_model_list_touches_nothing_outside_the_run(tmp_path, listed):
    """final_model_files.json names entries of output_dir only: a path out of it is ignored, and a list cut
    short (a crash while writing it) is no list: its run's files are left, never a file outside."""
    outside = tmp_path / "outside"
    outside.mkdir()
    make_trainer(tmp_path, max_steps=1).train()
    (tmp_path / "out" / "final_model_files.json").write_text(listed)
    make_trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert outside.is_dir() and (tmp_path / "out" / "metrics.jsonl").exists()


A_RUN_HELD_IN_STEP_3 = """
import os, sys, time
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
calls = []
def held(completion_ids, **kw):  # step 3's reward call takes 60 s
    calls.append(1)
    if len(calls) == 3:
        open({flag!r}, "w").close()
        time.sleep(60)
    return t.short_is_good(completion_ids)
t.make_trainer(Path({tmp!r}), held, max_steps=4, save_steps=1).train()
"""


def test_a_second_process_on_a_busy_output_dir_is_refused_and_a_killed_ones_lock_is_freed(tmp_path):
    """Two runs in one output_dir would interleave metrics.jsonl and collide on checkpoint folders: the
    second is refused at once. The lock is the kernel's on the open folder: SIGKILL frees it."""
    flag = tmp_path / "held"
    script = A_RUN_HELD_IN_STEP_3.format(here=os.path.dirname(os.path.abspath(__file__)), flag=str(flag),
                                         tmp=str(tmp_path))
    with child_at(flag, script):  # in step 3; SIGKILLed at the end of the block
        for resume in (None, True):
            with pytest.raises(ValueError, match="is locked: another process is training there"):
                make_trainer(tmp_path, max_steps=4, save_steps=1, overwrite_output_dir=True).train(resume)
        assert checkpoints(tmp_path / "out") == ["checkpoint-1", "checkpoint-2"]  # untouched
    make_trainer(tmp_path, max_steps=4, save_steps=1).train(resume_from_checkpoint=True)
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3, 4]


def test_a_refused_start_leaves_output_dir_unlocked(tmp_path):
    """A train() refused at its start (here: a checkpoint that does not exist) holds no lock afterwards."""
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError, match="not a checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere"))
    make_trainer(tmp_path).train()


def test_a_full_disk_names_output_dir_and_its_free_space_and_keeps_the_earlier_checkpoints(tmp_path,
                                                                                           monkeypatch):
    """torch.save into a full disk fails with `unexpected pos …` and no path. The error names output_dir and
    the space left there, the unfinished checkpoint-2.tmp is removed (it frees what it took), checkpoint-1
    stays, and the run resumes from it once there is room."""
    real_save = torch.save
    def into_a_full_disk(obj, path, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 2:
            os.symlink("/dev/full", path)  # every write there fails with ENOSPC
        return real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", into_a_full_disk)
    with pytest.raises(OSError, match=r"could not write '.*out' \(\d+ MiB free\): RuntimeError"):
        make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-1", "metrics.jsonl"]
    monkeypatch.undo()
    make_trainer(tmp_path, max_steps=3, save_steps=1).train(resume_from_checkpoint=True)
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3]


def test_resume_when_no_checkpoint_was_written_says_how_to_start_afresh(tmp_path):
    """A run killed before its first checkpoint leaves metrics.jsonl only: resuming says to start afresh
    with overwrite_output_dir=True, which a fresh start also asks for: no circle of messages."""
    make_trainer(tmp_path, max_steps=2, save_steps=100).train()
    for name in os.listdir(tmp_path / "out"):  # as after a SIGKILL in step 2
        if name != "metrics.jsonl":
            path = tmp_path / "out" / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(ValueError, match="holds no checkpoint.*overwrite_output_dir=True"):
        make_trainer(tmp_path).train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="overwrite_output_dir=True"):
        make_trainer(tmp_path).train()
    make_trainer(tmp_path, overwrite_output_dir=True).train()



# ---------------------------------------------------------------------------------------------------
# What a resume restores, or refuses by name
# ---------------------------------------------------------------------------------------------------
def numpy_reward(completion_ids, **kwargs):
    """short_is_good plus numpy noise: a reward with its own sampling (a judge's, a random check)."""
    return [r + 0.1 * numpy.random.rand() for r in short_is_good(completion_ids)]


def test_a_reward_that_draws_from_numpy_resumes_bit_identically(tmp_path):
    make_trainer(tmp_path, numpy_reward, max_steps=4, save_steps=2).train()
    assert_resumes_like_a_run_that_never_stopped(tmp_path, numpy_reward)


def test_a_resume_with_another_dataset_says_so(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    other = Dataset.from_dict({"prompt": PROMPTS[:5]})
    with pytest.warns(UserWarning, match="train_dataset '[0-9a-f]+' -> '[0-9a-f]+'"):
        make_trainer(tmp_path, dataset=other, max_steps=3).train(resume_from_checkpoint=True)


def test_a_checkpoint_whose_weights_are_a_pickle_names_the_missing_safetensors_file(tmp_path):
    """A checkpoint holding pytorch_model.bin (a pickle: it could run code) is never unpickled, and the error
    names the file that is missing, not one that is not there as if it were corrupt."""
    make_trainer(tmp_path, max_steps=1, save_steps=1).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    torch.save(safetensors.torch.load_file(checkpoint / "model.safetensors"),
               checkpoint / "pytorch_model.bin")
    os.remove(checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint-1/model.safetensors is missing"):
        make_trainer(tmp_path, max_steps=2).train(resume_from_checkpoint=True)


@pytest.mark.parametrize("other,match", [
    # (name, file's, model's)
    (dict(intermediate_size=128), r"mlp.down_proj.weight', \(32, 64\), \(32, 128\)"),
    (dict(num_hidden_layers=3), r"layers.2.input_layernorm.weight', None, \(32,\)")], ids=["wider", "deeper"])
def test_a_checkpoint_of_another_model_size_is_named_before_any_weight_loads(tmp_path, other, match):
    """load_state_dict would copy the tensors that fit before it raised on the first that does not (another
    width) or on the keys that one side lacks (another depth), leaving a model half one, half the other.
    Names and shapes are compared first: the file and a tensor are named, the model is untouched."""
    make_trainer(tmp_path, max_steps=1, save_steps=1).train()
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    model = LlamaForCausalLM(LlamaConfig(**{**model.config.to_dict(), **other}))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"checkpoint-1/model.safetensors is another model's .*" + match):
        make_trainer(tmp_path, model=model, tokenizer=tokenizer, max_steps=2).train(
            resume_from_checkpoint=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_gradient_checkpointing_set_back_to_false_turns_recomputation_off_again(tmp_path):
    trainer = make_trainer(tmp_path, gradient_checkpointing=True, overwrite_output_dir=True)
    trainer.train()
    assert trainer.model.is_activation_checkpointing
    trainer.args.gradient_checkpointing = False
    trainer.train()
    assert not trainer.model.is_activation_checkpointing


def test_a_model_replaced_between_two_runs_is_refused_by_name(tmp_path):
    """A new trainer.model is not what the optimizer updates: grad_norm > 0 and no weight would move."""
    trainer = make_trainer(tmp_path, overwrite_output_dir=True)
    trainer.train()
    trainer.model = make_model(trainer.tokenizer, seed=1)
    with pytest.raises(ValueError, match="trainable weights are not its optimizer's"):
        trainer.train()



def dict_reward(completions, **kw):
    return {i: 100.0 + i for i in range(len(completions))}  # iterating it gives the keys 0, 1, ...


def overflowing_reward(completions, **kw):
    return [1e39] * len(completions)  # a finite Python float, inf in float32


@pytest.mark.parametrize("func,error,match", [(dict_reward, TypeError, "dict|Mapping"),
                                              (overflowing_reward, ValueError, "overflowing_reward")])
def test_rewards_that_would_be_silently_wrong_are_refused(tmp_path, func, error, match):
    """A dict (whose keys are not the rewards) and a float32 overflow (inf) stop with a clear error."""
    with pytest.raises(error, match=match):
        make_trainer(tmp_path, reward_funcs=func).train()


def test_a_reward_function_that_edits_its_arguments_does_not_change_what_the_next_one_sees(tmp_path):
    """Each reward function gets the completions as generated, whatever the previous one did to its list."""
    seen = {}
    def editing(completions, **kw):
        seen["first"] = list(completions)
        rewards = [float(len(c)) for c in completions]
        completions[0] = "changed"
        return rewards
    def spy(completions, **kw):
        seen["second"] = list(completions)
        return [0.0] * len(completions)
    make_trainer(tmp_path, reward_funcs=[editing, spy]).generate_and_score(0)
    assert seen["second"] == seen["first"]


def test_config_values_given_as_strings_are_converted():
    """Values from a command line or a YAML file arrive as strings: they become the field's type."""
    config = GRPOConfig(learning_rate="1e-5", max_steps="3", bf16="true")
    assert (config.learning_rate, config.max_steps, config.bf16) == (1e-5, 3, True)
    assert type(config.learning_rate) is float and type(config.max_steps) is int
    assert GRPOConfig(bf16="false").bf16 is False


@pytest.mark.parametrize("field,value", [("learning_rate", "fast"), ("max_steps", 2.5),
                                         ("temperature", math.inf), ("learning_rate", math.nan),
                                         ("reward_weights", ["1"]), ("reward_weights", [math.nan]),
                                         ("reward_weights", [math.inf])])
def test_config_values_that_cannot_be_used_are_rejected(field, value):
    """Rejected when the config is made, by name: not a late TypeError, a truncation or a NaN loss."""
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value})


def test_a_prompt_that_renders_to_0_tokens_is_refused(tmp_path):
    """A chat template that renders a conversation to nothing leaves the model nothing to continue."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% if false %}x{% endif %}"
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    with pytest.raises(ValueError, match="0 tokens"):
        make_trainer(tmp_path, dataset=dataset, tokenizer=tokenizer, max_steps=1).train()


def test_a_pad_token_outside_the_models_vocabulary_is_refused_at_construction(tmp_path):
    """A pad id with no embedding would crash the first forward pass, or read stray memory on a GPU."""
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    tokenizer.add_special_tokens({"pad_token": "<new-pad>"})
    assert tokenizer.pad_token_id >= model.config.vocab_size
    with pytest.raises(ValueError, match="pad_token_id"):
        make_trainer(tmp_path, tokenizer=tokenizer, model=model)


def test_an_output_dir_that_is_a_file_is_refused_at_construction(tmp_path):
    """Not after a first step's worth of work, when the first checkpoint cannot be written."""
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(ValueError, match="output_dir"):
        make_trainer(tmp_path)


def test_a_model_with_nothing_to_train_is_refused_at_construction(tmp_path):
    """A frozen model would run the whole training and change nothing."""
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="trainable"):
        make_trainer(tmp_path, tokenizer=tokenizer, model=make_model(tokenizer).requires_grad_(False))


@pytest.mark.parametrize("column", ["completions", "prompts", "completion_ids"])
def test_a_dataset_column_that_would_shadow_a_reward_argument_is_refused(tmp_path, column):
    """Dataset columns reach the reward functions as keyword arguments: these names are taken."""
    with pytest.raises(ValueError, match=column):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": PROMPTS, column: PROMPTS}))


def test_more_torchrun_processes_than_gpus_are_refused_by_name(monkeypatch):
    """torchrun --nproc_per_node=2 on one GPU: LOCAL_RANK 1 names no device. Said before CUDA says 'invalid
    device ordinal' from deep inside set_device, or NCCL hangs with two ranks on one GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    (monkeypatch.setenv("RANK", "1"), monkeypatch.setenv("WORLD_SIZE", "2"),
     monkeypatch.setenv("LOCAL_RANK", "1"))
    with pytest.raises(ValueError, match="LOCAL_RANK=1 but 1 GPUs are visible"):
        gm.init_distributed()


def test_an_iterable_dataset_is_refused_at_construction(tmp_path):
    """The prompt order is a seeded permutation of the rows (what makes a resume exact): it needs a length."""
    with pytest.raises((TypeError, ValueError), match="map-style"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": PROMPTS}).to_iterable_dataset())


@pytest.mark.parametrize("varied_first", [True, False])
def test_rewards_that_never_differ_within_a_group_are_noticed_once(tmp_path, varied_first):
    """Every completion rewarded alike for 3 generation batches, from the start (a constant reward, a bug)
    or after learning (a collapsed policy), leaves nothing to learn: one warning, with advice."""
    calls = []
    def constant(completions, **kw):
        calls.append(1)
        return [float(i % 2) if len(calls) == 1 and varied_first else 1.0 for i in range(len(completions))]
    with pytest.warns(UserWarning, match="rewards were equal") as record:
        make_trainer(tmp_path, reward_funcs=constant, max_steps=6).train()
    messages = [str(w.message) for w in record if "rewards were equal" in str(w.message)]
    assert len(messages) == 1 and f"step {4 if varied_first else 3}" in messages[0], messages
    assert all(word in messages[0] for word in ("does not vary", "temperature", "collapsed", "learning rate"))


def test_metrics_jsonl_is_strict_json_with_null_where_a_reward_never_applied(tmp_path):
    """A reward function that returns None for a whole batch has no mean: null in metrics.jsonl, not NaN,
    which strict JSON readers (jq, JSON.parse) refuse."""
    make_trainer(tmp_path, reward_funcs=[short_is_good, never_applies], max_steps=1).train()
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    row = json.loads(open(tmp_path / "out" / "metrics.jsonl").readline(), parse_constant=refuse)
    assert row["rewards/never_applies"] is None and row["rewards/short_is_good"] >= 0
    assert (gm.strict_json({"step": 2, "run": "a", "grad_norm": math.inf})
            == '{"step": 2, "run": "a", "grad_norm": null}')


def test_the_health_metrics_count_flat_groups_and_truncated_completions(tmp_path):
    """frac_reward_zero_std: the share of groups whose rewards are all equal (advantages 0: no signal).
    completions/clipped_ratio: the share of completions that hit max_completion_length without an EOS."""
    trainer = make_trainer(tmp_path)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])     # group 0 flat, group 1 not
    truncated = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0])  # no EOS: cut at C tokens
    m = gm.batch_metrics(trainer, rewards[:, None], rewards, torch.ones(8, 3), truncated)
    assert (m["frac_reward_zero_std"], m["completions/clipped_ratio"]) == (0.5, 0.375)


def test_masked_truncated_completions_leave_the_loss_and_still_shape_their_groups_advantages(tmp_path,
                                                                                           monkeypatch):
    """mask_truncated_completions (DAPO's overlong filtering): a completion without an EOS gets no gradient
    and no place in the token normalizers, as if it had 0 tokens; its reward still counts in its group's
    mean and std. With max_completion_length=3 some completions are cut: the step's gradient is that of the
    loss over the others, with the advantages computed over all."""
    trainer = make_trainer(tmp_path, mask_truncated_completions=True, max_completion_length=3,
                           loss_type="dapo")
    reference = make_trainer(tmp_path, max_completion_length=3, loss_type="dapo")  # the same weights
    sample, calls = gm.sample_token, itertools.count()
    def some_end(logits, temperature):  # every other completion ends with its second token: not truncated
        token = sample(logits, temperature)
        if next(calls) == 1:
            token[::2] = trainer.tokenizer.eos_token_id
        return token
    monkeypatch.setattr(gm, "sample_token", some_end)
    grads = first_step_gradients(trainer)
    batch = dict(trainer.batch)
    truncated = ~torch.isin(batch["completion_ids"], trainer.eos_token_ids).any(1)
    assert 0 < truncated.sum() < len(truncated) and (batch["completion_mask"][truncated] == 0).all()
    logps = gm.plain_per_token_logps(reference.model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], 1.0)
    mask = batch["completion_mask"]
    loss = -(torch.exp(logps - logps.detach()) * batch["advantages"][:, None] * mask).sum() / mask.sum()
    loss.backward()
    for g, p in zip(grads, reference.model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_reward_functions_with_the_same_name_keep_a_metric_each(tmp_path):
    """Two lambdas (or two closures of one factory) are both named "<lambda>": numbered, not merged."""
    ones, twos = ((lambda completions, **kw: [1.0] * len(completions)),
                  (lambda completions, **kw: [2.0] * len(completions)))
    _, metrics = make_trainer(tmp_path, reward_funcs=[ones, twos]).generate_and_score(0)
    assert ((metrics["rewards/<lambda>_1"], metrics["rewards/<lambda>_2"], metrics["reward"])
            == (1.0, 2.0, 3.0))


def test_the_entropy_metric_is_the_policys_entropy_over_the_losss_tokens(tmp_path):
    """entropy (TRL's name): H(π_θ(· | q, o_<t)) = -Σ_v π(v) log π(v) at the temperature's logits, averaged
    over a step's completion tokens, from the training forward pass (the chunked LM head: no (b, C, V) at
    once). Known answer: the full softmax of the model's logits, masked the same way."""
    trainer = make_trainer(tmp_path, temperature=0.7)
    torch.manual_seed(0)
    batch, _ = trainer.generate_and_score(0)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logits = trainer.model(input_ids=ids, attention_mask=mask, position_ids=gm.position_ids(mask)).logits
        logp = (logits[:, batch["prompt_ids"].size(1) - 1:-1] / 0.7).log_softmax(-1)  # (B, C, V)
        entropy = -(logp.exp() * logp).sum(-1)                                       # (B, C)
        _, lean = gm.per_token_logps(trainer.model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], 0.7)
    m = batch["completion_mask"]
    torch.testing.assert_close(lean * m, entropy * m, rtol=1e-4, atol=1e-5)
    metrics = trainer.optimizer_step(batch)
    assert metrics["entropy"] == pytest.approx(float((entropy * m).sum() / m.sum()), rel=1e-4)
    assert 0 < metrics["entropy"] < math.log(len(trainer.tokenizer))  # at most the uniform's, log V


def test_a_folder_named_like_a_checkpoint_with_other_digits_is_not_one(tmp_path):
    """str.isdigit() takes '²' (and int() then fails): only checkpoint-<decimal digits> folders count."""
    for name in ("checkpoint-2", "checkpoint-²", "checkpoint-10", "checkpoint-x"):
        (tmp_path / name).mkdir()
    assert ([os.path.basename(c) for c in gm.list_checkpoints(str(tmp_path))]
            == ["checkpoint-2", "checkpoint-10"])


# ---------------------------------------------------------------------------------------------------
# The README's map from the objective's terms to the code stays true
# ---------------------------------------------------------------------------------------------------
def test_readme_term_table_links_the_lines_that_hold_the_quoted_code_in_part_one():
    """Each row of the README's term -> code table quotes a line of grpo_multistep.py and links to it. The
    quote must occur once in the file, at the linked line, in Part I (the algorithm: at most 360 lines)."""
    here = os.path.dirname(os.path.abspath(__file__))
    source = open(os.path.join(here, "grpo_multistep.py")).read().splitlines()
    part_two = next(i for i, text in enumerate(source, 1) if "PART II" in text)
    assert part_two <= 361, f"Part I runs to line {part_two - 1}"
    readme = open(os.path.join(here, "README.md")).read()
    rows = re.findall(r"\| `([^`]+)` \| \[L(\d+)\]\(grpo_multistep\.py#L(\d+)\)", readme)
    assert len(rows) >= 10
    for code, line, target in rows:
        assert line == target, f"README's link for {code!r} names line {line} but goes to {target}"
        found = [i for i, text in enumerate(source, 1) if code in text]
        assert len(found) == 1, f"README quotes {code!r}, found at lines {found} of grpo_multistep.py"
        assert int(line) == found[0] < part_two, f"README links {code!r} to line {line}, it is at {found[0]}"



# ---------------------------------------------------------------------------------------------------
# LoRA, the policy's dtype, 16-bit weights: what users from TRL, or on a small GPU, expect
# ---------------------------------------------------------------------------------------------------
def lora(**overrides):
    """TRL's usual LoRA: rank 4 on the attention's query and value projections."""
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                              "task_type": "CAUSAL_LM", **overrides})


def test_with_lora_only_the_adapter_trains_and_the_base_weights_stay_bit_identical(tmp_path):
    trainer = make_trainer(tmp_path, peft_config=lora(), max_steps=3, beta=0.1)
    adapter = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n for n in adapter)
    trainable = [p for n, p in trainer.model.named_parameters() if n in adapter]
    assert [p for group in trainer.optimizer.param_groups for p in group["params"]] == trainable
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for n, p in trainer.model.named_parameters():  # the base as it was, every adapter matrix moved
        assert torch.equal(p, before[n]) == (n not in adapter), n


def parameter_bytes(trainer):
    """The bytes of the weights that the trainer's attributes reach (policy, reference), each storage once."""
    modules = [v for v in vars(trainer).values() if isinstance(v, torch.nn.Module)]
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for m in modules for p in m.parameters()}
    return sum(storages.values())


def test_with_lora_the_reference_model_is_the_base_model_and_no_copy_of_the_weights(tmp_path):
    """β > 0 needs π_ref, the policy before training. A full model's is a frozen copy: twice the weights. With
    LoRA, π_ref is the policy with its adapter disabled: the base model, which never changes, at no cost."""
    full, full_kl = (parameter_bytes(make_trainer(tmp_path, beta=beta)) for beta in (0.0, 0.1))
    assert full_kl >= 2 * full
    tokenizer = make_tokenizer()
    lora_only, lora_kl = (make_trainer(tmp_path, tokenizer=tokenizer, beta=beta, peft_config=lora(),
                                       max_steps=2)
                          for beta in (0.0, 0.1))
    assert parameter_bytes(lora_kl) == parameter_bytes(lora_only) < full * 1.1
    lora_kl.train()  # step 2's generation batch comes after step 1's update: the adapter is no longer 0
    # the base: make_model's weights, as the adapter found them
    batch, base = lora_kl.batch, make_model(tokenizer)
    assert torch.equal(batch["ref_logps"], gm.cached_logps(lora_kl, base, batch))
    assert not torch.equal(batch["ref_logps"], gm.cached_logps(lora_kl, lora_kl.model, batch))


@pytest.mark.parametrize("how", ["peft_config", "PeftModel"])
def test_a_lora_run_resumes_bit_identically_from_a_checkpoint_inside_a_mu_cycle(tmp_path, how):
    """A checkpoint holds the adapter (and the optimizer's state of it), not the base model's weights."""
    peft = pytest.importorskip("peft")
    setup = (dict(peft_config=lora()) if how == "peft_config" else
             dict(model=lambda tokenizer: peft.get_peft_model(make_model(tokenizer), lora())))
    uninterrupted = run_to_end(tmp_path, "a", **setup)
    assert (sorted(os.listdir(tmp_path / "a" / "checkpoint-2"))
            == ["README.md", "adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"])
    assert_same_run(uninterrupted, run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-2"),
                                              **setup))


def test_an_adapter_checkpoint_of_other_modules_or_truncated_is_refused_by_name(tmp_path):
    """Resuming loads the adapter with peft's own loading, which would skip, silently, weights of modules
    that this model's adapter does not have: a checkpoint of another LoRA config is refused."""
    make_trainer(tmp_path, save_steps=1, peft_config=lora()).train()
    with pytest.raises(ValueError, match="adapter_model.safetensors is another model's .*lora"):
        make_trainer(tmp_path, save_steps=1, peft_config=lora(target_modules=["k_proj", "o_proj"])).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    damaged = tmp_path / "out" / "checkpoint-1" / "adapter_model.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    with pytest.raises(ValueError, match=re.escape(str(damaged)) + ".*corrupt"):
        make_trainer(tmp_path, save_steps=1, peft_config=lora()).train(
            resume_from_checkpoint=str(damaged.parent))


def test_the_final_save_is_the_adapter_that_from_pretrained_puts_back_on_the_base(tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer
    tokenizer = make_tokenizer()
    trainer = make_trainer(tmp_path, tokenizer=tokenizer, peft_config=lora()).train()
    out = tmp_path / "out"
    assert not (out / "model.safetensors").exists()  # the adapter alone: a few kB, not the model
    assert ({"adapter_config.json", "adapter_model.safetensors"}
            <= set(map(os.path.basename, gm.final_model_files(out))))
    # onto the base: make_model's weights again
    loaded = peft.PeftModel.from_pretrained(make_model(tokenizer), out)
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in loaded.named_parameters())
    assert AutoTokenizer.from_pretrained(out).get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("setup,match", [
    ("inject_adapter_in_model", "inject_adapter_in_model.*peft_config"),  # trains, but could not be saved
    ("lm_head", "an adapter on lm_head"),       # per_token_logps reads lm_head's weight: the adapter unseen
    ("modules_to_save", "an adapter on lm_head"),
    ("prompt_tuning", "logits are not lm_head"),  # virtual tokens that per_token_logps would not see
    ("two_adapters", r"adapters \['default', 'second'\]")])
def test_adapters_that_could_not_be_trained_checkpointed_or_saved_correctly_are_refused_by_name(tmp_path,
                                                                                                setup, match):
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()
    model, peft_config = make_model(tokenizer), None
    if setup == "inject_adapter_in_model":
        model = peft.inject_adapter_in_model(lora(), model)
    elif setup == "two_adapters":
        model = peft.get_peft_model(model, lora())
        model.add_adapter("second", lora())
    elif setup == "prompt_tuning":
        peft_config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    else:
        peft_config = (lora(target_modules=["lm_head"]) if setup == "lm_head"
                       else lora(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match=match):
        make_trainer(tmp_path, tokenizer=tokenizer, model=model, peft_config=peft_config)


def test_a_peft_config_without_peft_installed_says_what_to_install(tmp_path, monkeypatch):
    config = lora()
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now fails, as where it is not installed
    with pytest.raises(ImportError, match="pip install peft"):
        make_trainer(tmp_path, peft_config=config)


PEFT_IMPORTED = """
import sys
from pathlib import Path
sys.path[:0] = [{here!r}]
import test_grpo_multistep as t
tokenizer, folder = t.make_tokenizer(), {folder!r}
t.make_model(tokenizer).save_pretrained(folder)
tokenizer.save_pretrained(folder)
t.make_trainer(Path({tmp!r}), model=folder, beta=0.1, save_steps=1).train()
t.make_trainer(Path({tmp!r}), model=folder, beta=0.1, save_steps=1).train(resume_from_checkpoint=True)
print("peft imported:", "peft" in sys.modules)
"""


def test_peft_is_not_imported_unless_asked_for(tmp_path):
    """peft is optional: a run without an adapter (load, train, checkpoint, resume, save) never imports it."""
    pytest.importorskip("peft")  # else the test proves nothing
    script = PEFT_IMPORTED.format(here=os.path.dirname(os.path.abspath(__file__)),
                                  folder=str(tmp_path / "tiny"), tmp=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "peft imported: False" in result.stdout, result.stderr[-2000:]


def test_model_init_kwargs_load_a_folder_in_bfloat16_where_a_float32_lora_adapter_trains(tmp_path,
                                                                                         monkeypatch):
    """The small-GPU setup: a 16-bit base model (model_init_kwargs, TRL's name; default: float32, whatever the
    folder holds), LoRA adapters in float32 (peft's default), and the loss and its normalizers in float32."""
    tokenizer, folder = make_tokenizer(), str(tmp_path / "tiny")
    make_model(tokenizer).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert make_trainer(tmp_path, model=folder).model.dtype == torch.float32
    # a flag
    assert GRPOConfig(model_init_kwargs='{"dtype": "bfloat16"}').model_init_kwargs == {"dtype": "bfloat16"}
    dtypes, grpo_loss = set(), gm.grpo_loss
    def recording_loss(logps, old_logps, ref_logps, advantages, mask, args, num_seqs, num_tokens):
        loss, stats = grpo_loss(logps, old_logps, ref_logps, advantages, mask, args, num_seqs, num_tokens)
        dtypes.update(x.dtype for x in (logps, old_logps, ref_logps, advantages, num_seqs, num_tokens, loss))
        return loss, stats
    monkeypatch.setattr(gm, "grpo_loss", recording_loss)
    trainer = make_trainer(tmp_path, model=folder, model_init_kwargs={"dtype": "bfloat16"},
                           peft_config=lora(), beta=0.1, num_iterations=2, max_steps=3)
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    adapter = [p for p in trainer.model.parameters() if p.requires_grad]
    assert frozen == {torch.bfloat16} and {p.dtype for p in adapter} == {torch.float32}
    before = [p.detach().clone() for p in adapter]
    trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, adapter)) and dtypes == {torch.float32}
    with pytest.raises(ValueError, match="model_init_kwargs"):  # for a hub id or a folder, not a loaded model
        make_trainer(tmp_path, model=make_model(tokenizer), model_init_kwargs={"dtype": "bfloat16"})


def test_16_bit_trainable_weights_are_refused_before_adamw_would_round_their_updates_away(tmp_path):
    """AdamW's updates, about the learning rate, are below a 16-bit weight's rounding step: they would vanish
    silently. So 16-bit trainable weights are refused, at construction and, after a trainer.model.to(), at
    train(), before AdamW fails on a float32 state. (float32 weights under bf16=True are mixed precision.)"""
    for dtype, moved in [(torch.bfloat16, 0.0), (torch.float32, 1.0)]:  # why: one AdamW step at lr 1e-6
        w = torch.full((1000,), 0.01, dtype=dtype, requires_grad=True)
        w.grad = torch.randn_like(w)
        torch.optim.AdamW([w], lr=1e-6).step()
        # bf16: every update rounded away; float32: every weight moved
        assert (w != 0.01).float().mean() == moved
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="trainable weights are torch.bfloat16.*float32"):
        make_trainer(tmp_path, tokenizer=tokenizer, model=make_model(tokenizer).to(torch.bfloat16))
    trainer = make_trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    trainer.model.to(torch.bfloat16)
    with pytest.raises(ValueError, match="trainable weights are torch.bfloat16"):
        trainer.train()


# ---------------------------------------------------------------------------------------------------
# Reliability round 5: no folder's code runs, no user's file is overwritten, nothing is silently wrong
# ---------------------------------------------------------------------------------------------------
def asks_to_run_code(folder, marker):
    """Make `folder`'s config.json ask for a custom model class in a Python file that, if run, leaves
    `marker` behind (transformers' auto_map)."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    config.update(model_type="custom-llama", auto_map={"AutoConfig": "custom.Config",
                                                         "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")


def test_a_model_folder_that_asks_to_run_its_code_is_refused_by_name_and_runs_nothing(tmp_path):
    folder, marker = tmp_path / "model", tmp_path / "ran"
    make_model(make_tokenizer()).save_pretrained(folder)
    asks_to_run_code(folder, marker)
    with pytest.raises(ValueError, match="asks to run its own code .*'trust_remote_code': True"):
        make_trainer(tmp_path, model=str(folder))
    assert not marker.exists()


def test_resuming_a_checkpoint_whose_config_asks_to_run_code_runs_nothing(tmp_path):
    """A checkpoint's weights are read from its safetensors file alone: its config.json is never loaded."""
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    marker = tmp_path / "ran"
    asks_to_run_code(tmp_path / "out" / "checkpoint-1", marker)
    make_trainer(tmp_path, max_steps=2, save_steps=1).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert not marker.exists()


@pytest.mark.parametrize("name,adapter", [("config.json", False), ("tokenizer.json", False),
                                          ("README.md", True)])
def test_the_final_save_never_overwrites_a_users_file_unless_overwrite_is_asked(tmp_path, name, adapter):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("the user's")
    with pytest.raises(ValueError, match=f"holds {name}, which no run here wrote"):
        make_trainer(tmp_path, peft_config=lora() if adapter else None).train()
    assert (out / name).read_text() == "the user's" and sorted(os.listdir(out)) == [name]
    make_trainer(tmp_path, peft_config=lora() if adapter else None, overwrite_output_dir=True).train()
    assert (out / name).read_text() != "the user's"  # asked for


def fails_at_call(n):
    """short_is_good, except that its n-th call raises: a run that fails inside a step."""
    calls = []

    def reward(completion_ids, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("the reward server went away")
        return short_is_good(completion_ids)
    reward.__name__ = "short_is_good"  # its metric's name, as in the run it is compared with
    return reward


def test_the_metrics_of_steps_since_the_last_row_survive_a_checkpoint(tmp_path):
    """logging_steps = 3, a failure in step 5: checkpoint-4 holds step 4's metrics, which no row has yet.
    The resumed run's rows equal an uninterrupted run's: every step's metrics in exactly one row."""
    config = dict(max_steps=6, logging_steps=3, save_steps=100, gradient_accumulation_steps=1,
                  steps_per_generation=2)
    make_trainer(tmp_path / "a", **config).train()
    with pytest.raises(RuntimeError, match="reward server"):
        make_trainer(tmp_path / "b", reward_funcs=fails_at_call(3), **config).train()  # generation 3: step 5
    assert gm.list_checkpoints(str(tmp_path / "b" / "out"))[-1].endswith("checkpoint-4")
    make_trainer(tmp_path / "b", **config).train(resume_from_checkpoint=True)
    rows, uninterrupted = metrics_of(tmp_path / "b" / "out"), metrics_of(tmp_path / "a" / "out")
    assert [r["step"] for r in rows] == [3, 6] and rows == uninterrupted


def test_a_checkpoint_with_a_weight_missing_is_refused_by_name(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    file = tmp_path / "out" / "checkpoint-1" / "model.safetensors"
    weights = safetensors.torch.load_file(file)
    del weights["model.layers.0.mlp.up_proj.weight"]
    safetensors.torch.save_file(weights, file)
    with pytest.raises(ValueError,
                       match=r"another model's .*'model.layers.0.mlp.up_proj.weight', None, \(64, 32\)"):
        make_trainer(tmp_path, max_steps=2).train(resume_from_checkpoint=str(file.parent))


def edit_trainer_state(path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


@pytest.mark.parametrize("edit,match", [
    (lambda s: s["optimizer"]["state"].pop(0), "has the moments of 20 of the 21 saved"),
    (lambda s: s["optimizer"]["param_groups"][0]["params"].pop(), r"is for weights \[20\] \(per group\)"),
    (lambda s: s.pop("ranks"), r"lacks \['ranks'\]"),
    (lambda s: s["ranks"][0]["rng"].update(torch=torch.zeros(7, dtype=torch.uint8)),
     "random number states are garbled"),
])
def test_a_tampered_trainer_state_is_refused_before_anything_loads(tmp_path, edit, match):
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    edit_trainer_state(checkpoint / "trainer_state.pt", edit)
    trainer = make_trainer(tmp_path, max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=match):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing loaded


def test_steps_per_generation_none_and_its_value_spelled_out_resume_each_other(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_steps=1, gradient_accumulation_steps=1).train()
    make_trainer(tmp_path, max_steps=3, gradient_accumulation_steps=1, steps_per_generation=1).train(
        resume_from_checkpoint=True)
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3]


def test_a_checkpoint_folder_is_named_as_it_is_on_disk(tmp_path):
    (tmp_path / "checkpoint-003").mkdir()
    assert gm.list_checkpoints(str(tmp_path)) == [str(tmp_path / "checkpoint-003")]


@pytest.mark.parametrize("listed", ["null", "5", "[[1]]"])
def test_a_final_model_list_that_is_no_list_of_names_lists_nothing(tmp_path, listed):
    (tmp_path / "final_model_files.json").write_text(listed)
    assert gm.final_model_files(str(tmp_path)) == []


def test_overwrite_deletes_a_symlinked_checkpoint_as_a_link_never_what_it_points_to(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(tmp_path / "out" / "checkpoint-1"), elsewhere)
    os.symlink(elsewhere, tmp_path / "out" / "checkpoint-1")
    with pytest.warns(UserWarning, match="overwrite_output_dir deletes checkpoint-1"):
        make_trainer(tmp_path, max_steps=1, overwrite_output_dir=True).train()
    assert (elsewhere / "trainer_state.pt").exists() and not os.path.islink(tmp_path / "out" / "checkpoint-1")


def test_the_lora_initialisation_follows_the_seed(tmp_path):
    adapter = lambda t: [p.detach().clone() for n, p in t.model.named_parameters() if "lora_A" in n]
    a, b, c = (adapter(make_trainer(tmp_path, peft_config=lora(), seed=s)) for s in (3, 3, 4))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not any(torch.equal(x, z) for x, z in zip(a, c))


def test_a_changed_lora_config_is_refused_on_resume(tmp_path):
    make_trainer(tmp_path, peft_config=lora(), max_steps=2, save_steps=1).train()
    with pytest.raises(ValueError, match="adapter was made with another LoRA config"):
        make_trainer(tmp_path, peft_config=lora(lora_alpha=32), max_steps=2).train(
            resume_from_checkpoint=True)


def test_a_lora_adapter_checkpoint_resumed_into_a_full_model_run_says_so(tmp_path):
    make_trainer(tmp_path, peft_config=lora(), max_steps=2, save_steps=1).train()
    with pytest.raises(ValueError,
                       match="holds adapter_model.safetensors: a run that trained a LoRA adapter wrote it"):
        make_trainer(tmp_path, max_steps=2).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))


def zero_dim_numpy(completions, **kw):
    return numpy.array(1.0)


def zero_dim_tensor(completions, **kw):
    return torch.tensor(1.0)


def huge_int(completions, **kw):
    return [10**400] * len(completions)


@pytest.mark.parametrize("func,error,match", [
    (zero_dim_numpy, TypeError, "'zero_dim_numpy' returned a ndarray"),
    (zero_dim_tensor, TypeError, "'zero_dim_tensor' returned a Tensor"),
    (huge_int, ValueError, "'huge_int' returned 1000000.*finite in float32")])
def test_rewards_of_no_length_or_past_float32_name_the_function(tmp_path, func, error, match):
    with pytest.raises(error, match=match):
        make_trainer(tmp_path, reward_funcs=func).train()


def test_a_model_init_kwarg_that_nothing_takes_is_named(tmp_path):
    folder = tmp_path / "model"
    make_model(make_tokenizer()).save_pretrained(folder)
    with pytest.raises(ValueError, match="model_init_kwargs holds a keyword"):
        make_trainer(tmp_path, model=str(folder), model_init_kwargs={"dtpye": "bfloat16"})


def test_an_older_transformers_is_refused_at_import_with_both_versions():
    code = "import transformers; transformers.__version__ = '5.10.0'; import grpo_multistep"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    assert (result.returncode != 0
            and "needs transformers >= 5.24 (the requirements' range), found 5.10.0" in result.stderr)


def test_lora_on_the_input_embeddings_trains(tmp_path):
    """peft wraps embed_tokens in a layer without num_embeddings: the vocabulary is read from its weight."""
    trainer = make_trainer(tmp_path, peft_config=lora(target_modules=["embed_tokens", "q_proj"]), max_steps=1)
    trainer.train()
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1]


def test_a_peft_model_whose_only_adapter_is_not_named_default_is_refused_truly(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_model(make_tokenizer()), lora(), adapter_name="mine")
    with pytest.raises(ValueError,
                       match=r"adapters \['mine'\] are outside a PeftModel .*or not one named 'default'"):
        make_trainer(tmp_path, model=model)


ENDS_WITHOUT_DESTROYING = """
import atexit, os, sys
from pathlib import Path
import torch.distributed as dist
# Registered first, so it runs last (atexit is last in, first out): after grpo_multistep's own exit handler.
atexit.register(lambda: Path({tmp!r}, "rank" + sys.argv[1]).write_text(str(dist.is_initialized())))
sys.path[:0] = [{here!r}]
os.environ.update(RANK=sys.argv[1], LOCAL_RANK=sys.argv[1], WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="{port}")
import test_grpo_multistep as t
t.make_trainer(Path({tmp!r}), max_steps=1).train()  # a TRL-style script: it never destroys the group
"""


def test_the_process_group_the_trainer_made_is_destroyed_at_exit(tmp_path):
    ranks = two_ranks(ENDS_WITHOUT_DESTROYING, tmp_path)
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["False", "False"]


def bool_tensors(completion_ids, **kw):  # "short or not", as 0-d bool tensors: numbers 0 and 1
    return [torch.tensor(len(ids) < 6) for ids in completion_ids]


def test_a_reward_of_bool_tensors_counts_as_0_and_1(tmp_path):
    make_trainer(tmp_path, reward_funcs=bool_tensors, max_steps=1).train()
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1]
