"""The invariants of GRPO with μ-step optimization, as executable checks.

Everything runs offline on a tiny Llama (2 layers, hidden size 32) and a byte-level BPE tokenizer
trained here on a few sentences, so the whole file takes seconds on a CPU.
"""

import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types

import numpy
import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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
                 peft_config=None, eval_dataset=None, **overrides):
    tokenizer = tokenizer or make_tokenizer()
    config = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, num_generations=4, max_prompt_length=16,
                  max_completion_length=12, max_steps=2,
                  learning_rate=1e-2, logging_steps=1, max_grad_norm=0.0, seed=0)
    config.update(overrides)
    dataset = dataset if dataset is not None else Dataset.from_dict({"prompt": PROMPTS})
    return GRPOTrainer(model or make_model(tokenizer), reward_funcs, GRPOConfig(**config), dataset,
                       eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=peft_config)


def first_step_gradients(trainer):
    """Run the trainer's first optimizer step and return the gradients it applied (clipping is off)."""
    grads = []
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.extend(p.grad.clone() for p in trainer.model.parameters()))
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
    # Seed 3 samples one completion that ends early: micro-batches of unequal token counts (see bnpo).
    trainer = make_trainer(tmp_path, loss_type=loss_type, seed=3)
    reference = make_trainer(tmp_path, loss_type=loss_type, seed=3)  # same weights, same seed
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
    fresh = make_trainer(tmp_path).cached_logps(make_model(make_tokenizer()), batch)
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


def test_the_readmes_worked_schedule(tmp_path, monkeypatch):
    """README's example: gradient_accumulation_steps = 2, steps_per_generation = 8, num_iterations = 2,
    max_steps = 32. A generation batch holds S = 8 / 2 = 4 mini-batches and serves μ·S = 8 steps. Steps are
    counted as trainer.step counts them, from 0: it generates before steps 0, 8, 16 and 24, and steps 0-7
    use mini-batches 0 1 2 3 0 1 2 3 (two passes)."""
    trainer = make_trainer(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                           steps_per_generation=8, num_iterations=2, max_steps=32, max_completion_length=4)
    generated_before, used, split = [], [], gm.mini_batches
    generate_and_score, optimizer_step = trainer.generate_and_score, trainer.optimizer_step

    def generate(k):
        generated_before.append(trainer.step)  # the step about to be taken
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
    assert generated_before == [0, 8, 16, 24]
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
    assert metrics["clip_ratio/region_mean"] > 0


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


def test_the_loss_copied_alone_needs_only_epsilon_and_beta_and_reads_the_rest_with_trls_defaults():
    """grpo_loss works on a user's own config object: with only epsilon and beta, the other fields take TRL's
    defaults (epsilon_high = epsilon, token-level ratios, loss_type "grpo"), the same as GRPOConfig's."""
    old_logps, advantages = torch.zeros(2, 4), torch.tensor([1.0, -1.0])
    results = []
    own = types.SimpleNamespace(epsilon=0.1, beta=0.0)
    for args in (own, GRPOConfig(epsilon=0.1, max_completion_length=4)):
        logps = torch.log(torch.tensor([[0.85, 0.95, 1.05, 1.15]] * 2)).requires_grad_()
        loss, stats = grpo_loss(logps, old_logps, None, advantages, torch.ones(2, 4), args, 2, 8)
        loss.backward()
        results.append((loss, logps.grad, stats["clip_low"], stats["clip_high"]))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    # 0.85 < 1 - ε with A < 0; 1.15 > 1 + ε, A > 0
    assert (results[0][2].item(), results[0][3].item()) == (1, 1)


def test_the_loss_and_the_advantages_copied_alone_name_a_misspelt_choice():
    """Without GRPOConfig's checks, a name that is not one of the choices would fall into some branch and
    give a silently different loss or advantage ("batch" is a TRL scale_rewards that is not here)."""
    own = types.SimpleNamespace(epsilon=0.2, beta=0.0, loss_type="dr-grpo")
    logps = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="loss_type='dr-grpo'"):
        grpo_loss(logps, logps, None, torch.ones(2), torch.ones(2, 3), own, 2, 6)
    with pytest.raises(ValueError, match="scale_rewards='batch'"):
        group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), 2, "batch")
    with pytest.raises(ValueError, match=r"rewards of shape \(4, 2\) must be \(N,\)"):  # (N, F): per function
        group_advantages(torch.ones(4, 2), 2)


def test_dapo_with_every_token_masked_gives_a_zero_loss_not_nan():
    """DAPO's pairing with mask_truncated_completions: a step whose completions were all cut off has no loss
    token; its divisor is 1, as in TRL, so the step is a zero gradient, not a NaN one."""
    logps = torch.zeros(2, 3, requires_grad=True)
    args = types.SimpleNamespace(epsilon=0.2, beta=0.0, loss_type="dapo")
    no_tokens = torch.zeros(2, 3)
    loss, _ = grpo_loss(logps, logps.detach(), None, torch.ones(2), no_tokens, args, 2, torch.tensor(0.0))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logps.grad, torch.zeros(2, 3))


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
    assert stats["rewards/one/mean"] == 1.0 and stats["rewards/sometimes/mean"] == 3.0


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


def test_prompts_are_truncated_from_the_left():
    tokenizer = make_tokenizer()
    long_prompt = "the cat sat on the mat " * 5
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
    args = GRPOConfig(num_generations=3, per_device_train_batch_size=3, max_completion_length=8,
                      temperature=0.7)
    prompt_ids, prompt_mask, completion_ids, completion_mask = gm.generate_completions(
        model, tokenizer, ids, mask, args, [tokenizer.eos_token_id])
    assert torch.equal(prompt_ids, ids.repeat_interleave(3, 0))
    assert torch.equal(prompt_mask, mask.repeat_interleave(3, 0))
    assert completion_mask.sum(1).tolist() == [1, 2, 3, 4, 5, 6]
    assert (completion_ids[completion_mask == 0] == tokenizer.pad_token_id).all()
    assert rows_in == [ids.shape] + [(6, 1)] * 5  # 2 prompts once, then 5 decode steps: the 6th ends them all
    plain = plain_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    for t, logits in enumerate(seen):
        going = completion_mask[:, t].bool()
        torch.testing.assert_close(logits[going], plain[going, ids.size(1) - 1 + t], rtol=0, atol=1e-4)


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
    assert not trainer.model.training and torch.equal(first, second)


def test_each_epoch_draws_every_prompt_once_in_an_order_that_a_nearby_seed_does_not_repeat(tmp_path):
    """Generation batch k's prompts follow from (seed, k) alone: each epoch is a shuffle of all n rows, and
    seed 1's second epoch is not seed 2's first, so runs of nearby seeds never train in step."""
    def two_epochs(seed):  # make_trainer's steps take 2 prompts each
        trainer = make_trainer(tmp_path, seed=seed)
        order = [i for k in range(len(PROMPTS)) for i in gm.prompt_rows(trainer, k)]
        return order[:len(PROMPTS)], order[len(PROMPTS):]
    (first, second), (next_seeds_first, _) = two_epochs(1), two_epochs(2)
    assert sorted(first) == sorted(second) == list(range(len(PROMPTS))) and first != second
    assert second != next_seeds_first


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
             processing_class=tokenizer).train()
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.25, rewards


# ---------------------------------------------------------------------------------------------------
# Checkpoints: a resume is bit-identical, inside a generation batch too
# ---------------------------------------------------------------------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE}  # child processes import this file


def run_to_end(tmp_path, name, resume=None, stop_at=None, model=None, peft_config=None, eval_dataset=None,
               **overrides):
    """Train 6 steps with μ = 3 and a checkpoint every 2 steps (so steps 2 and 4 fall inside a generation
    batch); return the final weights and the logged metrics without the timings. `stop_at` stands for
    Ctrl-C after that step's row. model: a function of the tokenizer (default: make_model)."""
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
                       Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=eval_dataset,
                       processing_class=tokenizer, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in trainer.model.parameters()], logged


def assert_same_run(a, b):
    (weights_a, metrics_a), (weights_b, metrics_b) = a, b
    assert all(torch.equal(x, y) for x, y in zip(weights_a, weights_b))
    assert metrics_a[-len(metrics_b):] == metrics_b


def metrics_of(out):
    """metrics.jsonl without the timings: what a resumed run must log exactly like an uninterrupted one."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "elapsed"} for r in rows]


def checkpoints(out):  # The complete ones, oldest first.
    names = [n for n in os.listdir(out) if n.startswith("checkpoint-") and n[11:].isdecimal()]
    return sorted(names, key=lambda n: int(n[11:]))


@pytest.mark.parametrize("checkpoint,mu,spg", [(2, 3, None), (3, 3, None), (4, 3, None), (1, 1, 6),
                                               (5, 2, 4)])
def test_resuming_from_a_checkpoint_is_bit_identical(tmp_path, checkpoint, mu, spg):
    """Inside a generation batch (μ = 3: steps 2, 4; S = 3: step 1; μ = 2, S = 2: step 5) and at its end.
    Inside one, the checkpoint holds the batch: the completions and log-probs its remaining steps reuse."""
    shape = dict(num_iterations=mu, steps_per_generation=spg)
    uninterrupted = run_to_end(tmp_path, "a", save_steps=1, **shape)
    resumed = run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / f"checkpoint-{checkpoint}"), **shape)
    assert_same_run(uninterrupted, resumed)
    assert len(resumed[1]) == 6 - checkpoint


def test_a_reward_that_draws_from_numpy_resumes_bit_identically(tmp_path):
    """Every generation batch seeds Python's, numpy's and torch's generators from (seed, batch, process):
    a reward function's own draws repeat on a resume, with no random state in the checkpoint."""
    def numpy_reward(completion_ids, **kwargs):
        return [r + 0.1 * numpy.random.rand() for r in short_is_good(completion_ids)]
    make_trainer(tmp_path, numpy_reward, max_steps=4, save_steps=2, output_dir=str(tmp_path / "a")).train()
    whole = make_trainer(tmp_path, numpy_reward, max_steps=4, output_dir=str(tmp_path / "whole")).train()
    resumed = make_trainer(tmp_path, numpy_reward, max_steps=4, output_dir=str(tmp_path / "b"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


def test_a_failure_while_writing_a_checkpoint_leaves_the_previous_one_loadable(tmp_path, monkeypatch):
    """A checkpoint is written to checkpoint-<step>.tmp and renamed: complete or absent. A failure in the
    middle (a full disk, a kill) leaves the previous one, which resumes; the resumed run logs each step
    once."""
    save = torch.save
    def disk_full(obj, path, *args, **kwargs):  # checkpoint-4's model is written, AdamW's state not yet
        if str(path).endswith("checkpoint-4.tmp/optimizer.pt"):
            raise OSError(28, "No space left on device")
        save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        run_to_end(tmp_path, "run")
    monkeypatch.setattr(torch, "save", save)
    run = tmp_path / "run"
    assert sorted(os.listdir(run)) == ["checkpoint-2", "checkpoint-4.tmp", "metrics.jsonl"]
    assert checkpoints(run) == ["checkpoint-2"]
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4]  # steps 3, 4: done, but not checkpointed
    assert_same_run(run_to_end(tmp_path, "a"), run_to_end(tmp_path, "run", resume=str(run / "checkpoint-2")))
    assert [r["step"] for r in metrics_of(run)] == [1, 2, 3, 4, 5, 6]  # each step once
    assert "checkpoint-4.tmp" not in os.listdir(run)


def test_a_resume_that_is_not_this_runs_checkpoint_is_refused_before_anything_loads(tmp_path):
    """Not a checkpoint folder (the missing file is named); another batch shape (the prompt order and the
    saved batch depend on it); another model's weights, even where every shape they share agrees."""
    run_to_end(tmp_path, "a")
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        run_to_end(tmp_path, "b", resume=str(tmp_path))
    with pytest.raises(ValueError, match=r"another batch shape.*'num_iterations': \(3, 2\)"):
        run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-2"), num_iterations=2)

    def one_layer_more(tokenizer):  # Its first two layers have the names and shapes of the checkpoint's.
        config = make_model(tokenizer).config
        config.num_hidden_layers = 3
        return LlamaForCausalLM(config)
    with pytest.raises(ValueError, match=r"another model's weights \(\['model.layers.2.input_layernorm"):
        run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-2"), model=one_layer_more)


def test_resume_from_checkpoint_true_takes_the_newest_complete_checkpoint_as_in_hfs_trainer(tmp_path):
    """checkpoint-10 sorts before checkpoint-4 as text; a .tmp folder is a checkpoint never finished."""
    make_trainer(tmp_path, max_steps=10, save_steps=4).train()  # checkpoints 4, 8 and 10
    out = tmp_path / "out"
    os.rename(out / "checkpoint-8", out / "checkpoint-12.tmp")
    resumed = make_trainer(tmp_path, max_steps=11)
    taken = []
    end_of_step = resumed.end_of_step
    def counted(metrics):
        taken.append(resumed.step)
        end_of_step(metrics)
    resumed.end_of_step = counted
    resumed.train(resume_from_checkpoint=True)
    assert taken == [11]
    assert [r["step"] for r in metrics_of(out)] == list(range(1, 12))
    with pytest.raises(ValueError, match="holds no checkpoint to resume"):
        make_trainer(tmp_path, output_dir=str(tmp_path / "empty")).train(resume_from_checkpoint=True)


# ---------------------------------------------------------------------------------------------------
# Loading runs no code; a fresh run never mixes with files already in output_dir
# ---------------------------------------------------------------------------------------------------
def test_a_pickled_trainer_state_never_runs_code(tmp_path):
    """Resuming unpickles only tensors and plain data (weights_only): an object that would run code fails."""
    make_trainer(tmp_path, save_steps=1).train()
    state_file, marker = tmp_path / "out" / "checkpoint-1" / "optimizer.pt", tmp_path / "ran"

    class RunsCode:
        def __reduce__(self):  # unpickling this object calls exec(...)
            return (exec, (f"open({str(marker)!r}, 'w').write('x')",))
    torch.save({**torch.load(state_file, weights_only=False), "note": RunsCode()}, state_file)
    with pytest.raises(Exception, match="Weights only load failed"):
        make_trainer(tmp_path, save_steps=1).train(resume_from_checkpoint=str(state_file.parent))
    assert not marker.exists()


def asks_to_run_code(folder, marker):
    """Make `folder`'s config.json ask for a custom model class in a Python file that, if run, leaves
    `marker` behind (transformers' auto_map)."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    config.update(model_type="custom-llama", auto_map={"AutoConfig": "custom.Config",
                                                         "AutoModelForCausalLM": "custom.Model"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")


def test_a_model_folder_or_a_checkpoint_that_asks_to_run_its_code_runs_nothing(tmp_path):
    """A model folder is loaded with trust_remote_code=False (transformers refuses, naming the option); a
    checkpoint's weights are read from its safetensors file alone: its config.json is never loaded."""
    folder, marker = tmp_path / "model", tmp_path / "ran"
    make_model(make_tokenizer()).save_pretrained(folder)
    asks_to_run_code(folder, marker)
    with pytest.raises(ValueError, match="trust_remote_code"):
        make_trainer(tmp_path, model=str(folder))
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    asks_to_run_code(tmp_path / "out" / "checkpoint-1", marker)
    make_trainer(tmp_path, max_steps=2, save_steps=1, output_dir=str(tmp_path / "b")).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------------
# Bad input fails at the start, with a message that names it
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,match", [
    ("num_generations", 1, "num_generations=1"),
    ("num_iterations", 0, "num_iterations=0"),
    ("epsilon", 0.0, "epsilon=0.0"),
    ("epsilon", 1.5, "epsilon=1.5"),
    ("epsilon_high", 0.0, "epsilon_high=0.0"),
    ("temperature", 0.0, "temperature=0.0"),
    ("beta", -0.1, "beta=-0.1"),
    ("max_completion_length", 0, "max_completion_length=0"),
    ("logging_steps", 0, "logging_steps=0"),
    ("loss_type", "ppo", "loss_type='ppo'"),
    ("scale_rewards", "batch", "scale_rewards='batch'"),
    ("importance_sampling_level", "sequences", "importance_sampling_level='sequences'"),
    ("eval_strategy", "sometimes", "eval_strategy='sometimes'"),
    ("steps_per_generation", 3, "steps_per_generation=3 is not a multiple of gradient_accumulation_steps=2"),
])
def test_bad_config_values_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{"gradient_accumulation_steps": 2, field: value})


def never_applies(completions, **kw):
    return [None] * len(completions)


def test_bad_trainer_inputs_are_rejected_before_training(tmp_path):
    with pytest.raises(ValueError, match="not divisible by num_generations=4"):
        make_trainer(tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="train_dataset must be a datasets.Dataset with rows"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="'prompt' column"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"text": PROMPTS}))
    tokenizer = make_tokenizer()
    for not_a_dataset in (None, PROMPTS):
        with pytest.raises(ValueError, match="train_dataset must be a datasets.Dataset"):
            GRPOTrainer(make_model(tokenizer), short_is_good, GRPOConfig(), not_a_dataset,
                        processing_class=tokenizer)
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token"):
        make_trainer(tmp_path, tokenizer=tokenizer)


def test_train_refuses_reward_weights_of_another_count_and_an_evaluation_without_prompts(tmp_path):
    """One weight for two functions would broadcast silently; an evaluation with no eval_dataset would fail
    at its first evaluation, deep inside."""
    with pytest.raises(ValueError, match=r"reward_weights=\[2.0\] needs one weight per reward function"):
        make_trainer(tmp_path, reward_funcs=[short_is_good, never_applies], reward_weights=[2.0]).train()
    with pytest.raises(ValueError, match="eval_strategy='steps' needs an eval_dataset"):
        make_trainer(tmp_path, eval_strategy="steps").train()


def test_beta_raised_after_the_trainer_was_made_is_refused_as_it_has_no_reference_model(tmp_path):
    """With β = 0 the trainer makes no π_ref (no copy of the weights); the KL term would have nothing."""
    trainer = make_trainer(tmp_path)
    trainer.args.beta = 0.1
    with pytest.raises(ValueError, match="beta was 0 when the trainer was made"):
        trainer.train()


def too_few(completions, **kw):
    return [1.0]


def unbounded(completions, **kw):  # An infinite reward would give NaN advantages, then NaN gradients.
    return [math.inf] * len(completions)


@pytest.mark.parametrize("func,error,match", [
    (too_few, ValueError, "reward function 'too_few' returned 1 values for 8 completions"),
    (never_applies, ValueError, r"every reward function returned None or NaN for completion \[0\]"),
    (unbounded, ValueError, "reward function 'unbounded' returned an infinite reward"),
])
def test_bad_reward_functions_are_named(tmp_path, func, error, match):
    with pytest.raises(error, match=match):
        make_trainer(tmp_path, reward_funcs=func).train()


def test_16_bit_trainable_weights_are_refused_before_adamw_would_round_their_updates_away(tmp_path):
    """AdamW's updates, about the learning rate, are below a 16-bit weight's rounding step: they would vanish
    silently. (float32 weights under bf16=True are mixed precision, and train.)"""
    for dtype, moved in [(torch.bfloat16, 0.0), (torch.float32, 1.0)]:  # why: one AdamW step at lr 1e-6
        w = torch.full((1000,), 0.01, dtype=dtype, requires_grad=True)
        w.grad = torch.randn_like(w)
        torch.optim.AdamW([w], lr=1e-6).step()
        assert (w != 0.01).float().mean() == moved
    tokenizer = make_tokenizer()
    with pytest.raises(ValueError, match="trainable weights are \\['torch.bfloat16'\\].*float32"):
        make_trainer(tmp_path, tokenizer=tokenizer, model=make_model(tokenizer).to(torch.bfloat16)).train()


# ---------------------------------------------------------------------------------------------------
# Metrics, with TRL's names
# ---------------------------------------------------------------------------------------------------
def test_every_row_has_the_same_keys_with_null_where_its_steps_sampled_nothing(tmp_path):
    """μ = 2, a row per step: the second step reuses the first's generation batch, so its reward is NaN in
    log() and null in metrics.jsonl; a log() that reads a row's reward finds the key in every row."""
    rewards = []
    trainer = make_trainer(tmp_path, num_iterations=2, max_steps=4)
    def log(row):
        rewards.append(row["reward"])
        GRPOTrainer.log(trainer, row)
    trainer.log = log
    trainer.train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert len({tuple(sorted(r)) for r in rows}) == 1
    assert [r["reward"] is None for r in rows] == [False, True, False, True]
    assert [math.isnan(r) for r in rewards] == [False, True, False, True]


def test_a_second_train_starts_afresh_adamw_included(tmp_path):
    """As in HF's Trainer: train() again, without a resume, is a new run; AdamW's moments start from zero."""
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.train()
    trainer.train()
    steps = {int(state["step"]) for state in trainer.optimizer.state.values()}
    assert steps == {2} and trainer.step == 2


def test_metrics_jsonl_is_strict_json_with_null_where_a_reward_never_applied(tmp_path):
    """A reward function that returns None for a whole batch has no mean: null in metrics.jsonl, not NaN,
    which strict JSON readers (jq, JSON.parse) refuse."""
    make_trainer(tmp_path, reward_funcs=[short_is_good, never_applies], max_steps=1).train()
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    row = json.loads(open(tmp_path / "out" / "metrics.jsonl").readline(), parse_constant=refuse)
    assert row["rewards/never_applies/mean"] is None and row["rewards/short_is_good/mean"] >= 0
    for name in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                 "completions/clipped_ratio", "clip_ratio/low_mean", "clip_ratio/high_mean",
                 "clip_ratio/region_mean", "entropy", "loss", "grad_norm", "learning_rate"):
        assert name in row, name  # TRL's names: a TRL dashboard reads these rows


def test_the_health_metrics_count_flat_groups_and_truncated_completions(tmp_path):
    """frac_reward_zero_std: the share of groups whose rewards are all equal (advantages 0: no signal).
    completions/clipped_ratio: the share of completions that hit max_completion_length without an EOS."""
    trainer = make_trainer(tmp_path)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])     # group 0 flat, group 1 not
    truncated = torch.tensor([True, False, False, False, True, True, False, False])
    m = gm.batch_metrics(trainer, dict(rewards_per_func=rewards[:, None], rewards=rewards,
                                       truncated=truncated, lengths=torch.full((8,), 3)))
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
    logps = gm.per_token_logps(reference.model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], 1.0)[0]
    mask = batch["completion_mask"]
    loss = -(torch.exp(logps - logps.detach()) * batch["advantages"][:, None] * mask).sum() / mask.sum()
    loss.backward()
    for g, p in zip(grads, reference.model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_the_entropy_metric_is_the_policys_entropy_over_the_losss_tokens(tmp_path):
    """entropy (TRL's name): H(π_θ(· | q, o_<t)) = -Σ_v π(v) log π(v) at the temperature's logits, averaged
    over a step's completion tokens, from the training forward pass (the chunked LM head: no (b, C, V) at
    once). Known answer: the full softmax of the model's logits, masked the same way."""
    trainer = make_trainer(tmp_path, temperature=0.7)
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


# ---------------------------------------------------------------------------------------------------
# A held-out evaluation, and report_to
# ---------------------------------------------------------------------------------------------------
EVAL_PROMPTS = ["a held out prompt", "another one", "the third", "and a fourth"]


def test_eval_reward_is_a_plain_sampling_and_scoring_of_the_held_out_prompts(tmp_path):
    """evaluate(): eval_dataset's prompts, G completions each, decoded to their first EOS and scored by the
    reward functions as in training; eval_reward is their mean. Checked against the same done by hand with
    the building blocks, seeded as evaluate() seeds, in generation batches of 2 prompts (4·2 / 4)."""
    def length(completions, **kwargs):  # of the decoded text
        return [float(len(c)) for c in completions]
    trainer = make_trainer(tmp_path, reward_funcs=length, seed=3,
                           eval_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS}))
    metrics = trainer.evaluate()
    gm.seed_random_generators(trainer, "eval", 0)
    rewards = []
    for i in (0, 2):
        ids, mask = gm.tokenize_prompts(trainer.tokenizer, EVAL_PROMPTS[i:i + 2], 16)
        _, _, completion_ids, cmask = gm.generate_completions(trainer.model, trainer.tokenizer, ids, mask,
                                                              trainer.args, trainer.eos_token_ids)
        ends = [row[:n] for row, n in zip(completion_ids.tolist(), cmask.sum(1).tolist())]  # to the first EOS
        rewards += length(trainer.tokenizer.batch_decode(ends, skip_special_tokens=True))
    assert metrics["eval_reward"] == pytest.approx(sum(rewards) / len(rewards), rel=1e-6)
    assert metrics["eval_rewards/length/mean"] == metrics["eval_reward"]
    assert trainer.evaluate()["eval_reward"] == metrics["eval_reward"]  # seeded alike at every evaluation


def test_a_run_with_evaluations_makes_the_same_updates_and_resumes_bit_identically(tmp_path):
    """The next generation batch seeds itself anew after an evaluation: the run with evaluations makes
    bit-identical updates to the run without, and a run stopped and resumed logs the same evaluations and
    ends with the same weights."""
    held_out = Dataset.from_dict({"prompt": EVAL_PROMPTS})
    plain, plain_logged = run_to_end(tmp_path, "plain")
    evaluated, logged = run_to_end(tmp_path, "eval", eval_dataset=held_out, eval_strategy="steps",
                                   eval_steps=2)
    for a, b in zip(plain, evaluated):
        assert torch.equal(a, b)
    assert [{k: v for k, v in row.items() if not k.startswith("eval_")} for row in logged] == plain_logged
    assert [row["step"] for row in logged if "eval_reward" in row] == [2, 4, 6]
    with pytest.raises(KeyboardInterrupt):
        run_to_end(tmp_path, "resumed", stop_at=3, eval_dataset=held_out, eval_strategy="steps", eval_steps=2)
    checkpoint = str(tmp_path / "resumed" / "checkpoint-2")
    resumed, resumed_logged = run_to_end(tmp_path, "resumed", resume=checkpoint, eval_dataset=held_out,
                                         eval_strategy="steps", eval_steps=2)
    for a, b in zip(evaluated, resumed):
        assert torch.equal(a, b)
    assert resumed_logged == [row for row in logged if row["step"] > 2]  # from checkpoint-2


# ---------------------------------------------------------------------------------------------------
# LoRA: the adapter trains, checkpoints and saves; π_ref is the base model, no copy
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
    batch, base = lora_kl.batch, make_model(tokenizer)  # the base: make_model's weights
    assert torch.equal(batch["ref_logps"], lora_kl.cached_logps(base, batch))
    assert not torch.equal(batch["ref_logps"], lora_kl.cached_logps(lora_kl.model, batch))


@pytest.mark.parametrize("how", ["peft_config", "PeftModel"])
def test_a_lora_run_resumes_bit_identically_from_a_checkpoint_inside_a_generation_batch(tmp_path, how):
    """A checkpoint holds the adapter (and the optimizer's state of it), not the base model's weights."""
    peft = pytest.importorskip("peft")
    setup = dict(peft_config=lora())
    if how == "PeftModel":
        setup = dict(model=lambda tokenizer: peft.get_peft_model(make_model(tokenizer), lora()))
    uninterrupted = run_to_end(tmp_path, "a", **setup)
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "a" / "checkpoint-2")
    assert "model.safetensors" not in os.listdir(tmp_path / "a" / "checkpoint-2")
    assert_same_run(uninterrupted, run_to_end(tmp_path, "b", resume=str(tmp_path / "a" / "checkpoint-2"),
                                              **setup))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        run_to_end(tmp_path, "c", resume=str(tmp_path / "a" / "checkpoint-2"))  # into a run without LoRA


def test_the_final_save_is_the_adapter_that_from_pretrained_puts_back_on_the_base(tmp_path):
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()
    trainer = make_trainer(tmp_path, tokenizer=tokenizer, peft_config=lora()).train()
    out = tmp_path / "out"
    assert not (out / "model.safetensors").exists() and (out / "adapter_model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(make_model(tokenizer), out)  # onto the base: make_model's weights
    trained = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, trained[n]) for n, p in loaded.named_parameters())


PEFT_IMPORTED = """
import sys
from pathlib import Path
import test_grpo_multistep as t
tokenizer, folder = t.make_tokenizer(), {folder!r}
t.make_model(tokenizer).save_pretrained(folder)
tokenizer.save_pretrained(folder)
t.make_trainer(Path({tmp!r}), model=folder, beta=0.1, save_steps=1).train()
resumed = t.make_trainer(Path({tmp!r}), model=folder, beta=0.1, max_steps=3)
resumed.train(resume_from_checkpoint={checkpoint!r})
print("peft imported:", "peft" in sys.modules)
"""


def test_peft_is_not_imported_unless_asked_for(tmp_path):
    """peft is optional: a run without an adapter (load, train, checkpoint, resume, save) never imports it."""
    pytest.importorskip("peft")  # else the test proves nothing
    script = PEFT_IMPORTED.format(folder=str(tmp_path / "tiny"), tmp=str(tmp_path),
                                  checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=CHILD_ENV)
    assert "peft imported: False" in result.stdout, result.stderr[-2000:]


COPIED_ALONE = """
import sys
from datasets import Dataset
from transformers import AutoModelForCausalLM
from grpo_multistep import GRPOConfig, GRPOTrainer
def short(completion_ids, **kwargs):
    return [sum(t < 150 for t in ids) / max(len(ids), 1) for ids in completion_ids]
def run(out, **overrides):
    config = GRPOConfig(output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                        num_generations=4, max_completion_length=8, max_steps=4, num_iterations=2, seed=0,
                        learning_rate=1e-2, logging_steps=1, save_steps=1, eval_strategy="steps",
                        eval_steps=2, **overrides)
    return GRPOTrainer("tiny", short, config, Dataset.from_dict({{"prompt": {prompts!r}}}),
                       eval_dataset=Dataset.from_dict({{"prompt": {prompts!r}[:4]}}))
run("whole").train()
run("resumed").train(resume_from_checkpoint="whole/checkpoint-3")  # inside a μ = 2 generation batch
run("none", save_strategy="no").train()
weights = [AutoModelForCausalLM.from_pretrained(d).state_dict() for d in ("whole", "resumed")]
print("same:", all(weights[0][k].equal(weights[1][k]) for k in weights[0]))
"""


def test_the_file_copied_alone_trains_evaluates_checkpoints_and_resumes_bit_identically(tmp_path):
    """grpo_multistep.py in an empty folder, nothing else of this repository on the path: it trains a tiny
    model from a folder, evaluates, checkpoints every step, resumes inside a generation batch to the same
    weights, and with save_strategy='no' writes no checkpoint; from_pretrained loads each final model."""
    shutil.copy(os.path.join(HERE, "grpo_multistep.py"), tmp_path)
    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", COPIED_ALONE.format(prompts=PROMPTS)], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "same: True" in result.stdout
    assert "checkpoint-3" in os.listdir(tmp_path / "whole")
    assert not [n for n in os.listdir(tmp_path / "none") if n.startswith("checkpoint")]
    rows = [json.loads(line) for line in open(tmp_path / "whole" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and "eval_reward" in rows[1]


# ---------------------------------------------------------------------------------------------------
# The README's map from the objective's terms to the code stays true
# ---------------------------------------------------------------------------------------------------
def test_readme_term_table_links_the_lines_that_hold_the_quoted_code_in_part_one():
    """Each row of the README's term -> code table quotes a line of grpo_multistep.py and links to it. The
    quote must occur once in the file, at the linked line, in Part I (the algorithm)."""
    source = open(os.path.join(HERE, "grpo_multistep.py")).read().splitlines()
    part_two = next(i for i, text in enumerate(source, 1) if "PART II" in text)
    readme = open(os.path.join(HERE, "README.md")).read()
    rows = re.findall(r"\| `([^`]+)` \| \[L(\d+)\]\(grpo_multistep\.py#L(\d+)\)", readme)
    assert len(rows) >= 10
    for code, line, target in rows:
        assert line == target, f"README's link for {code!r} names line {line} but goes to {target}"
        found = [i for i, text in enumerate(source, 1) if code in text]
        assert len(found) == 1, f"README quotes {code!r}, found at lines {found} of grpo_multistep.py"
        assert int(line) == found[0] < part_two, f"README links {code!r} to line {line}, it is at {found[0]}"
