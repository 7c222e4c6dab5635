"""
GRPO with multi-step (μ) optimization, in one file.

GRPO (Group Relative Policy Optimization, DeepSeekMath, Algorithm 1) trains a language model with
rewards instead of labels. For each prompt q it samples a *group* of G completions o_1..o_G, scores
them, and uses each completion's reward, normalized within its group, as the advantage of every one
of its tokens:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4)

The multi-step trick (TRL PR "6x faster GRPO with multi-step optimization") reuses one batch of
generations for μ = `num_iterations` optimizer steps. After the first step the policy π_θ is no longer
the policy π_old that sampled the completions, so the loss carries the PPO importance ratio, clipped:

    coef_1 = π_θ(o_t) / π_old(o_t) = exp(logp - old_logp)
    coef_2 = clamp(coef_1, 1 - ε, 1 + ε_high)
    loss_t = -min(coef_1 · A, coef_2 · A) + β · KL_t(π_θ ‖ π_ref)

π_old's log-probs are computed once per generation batch and cached. With μ = 1 the policy being
trained *is* π_old, so old_logp = logp.detach(): no extra forward pass, and the gradient is exactly
that of the single-step GRPO loss -exp(logp - logp.detach()) · A.

The file reads top to bottom in the order of Algorithm 1:
  1. Config                          GRPOConfig (TRL's field names)
  2. Generation                      prompts -> G sampled completions, completion mask
  3. Rewards and advantages          reward functions -> group-normalized advantages
  4. Per-token log-probs             log π(o_t | q, o_<t) of the completion tokens
  5. The clipped objective           grpo_loss, one line per term
  6. The μ-iteration loop            GRPOTrainer: generate -> score -> cache -> μ optimizer steps
  7. Checkpoints                     save and resume, bit-identical on CPU

Simplifications, on purpose: generation is a plain sampling loop with the model's KV cache (no vLLM,
no `model.generate`: nothing but softmax(logits / T) picks the tokens); one generation batch is one
optimizer step's batch; data parallelism is a gradient all-reduce (torchrun), no DeepSpeed/FSDP;
no PEFT; the learning-rate schedule is linear or constant, without warmup.
"""

import copy
import json
import math
import numbers
import os
import random
import shutil
import socket
import time
import urllib.parse
import warnings
from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass, field

import huggingface_hub
import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


# ----------------------------------------------------------------------------------------------------
# 1. Config
# ----------------------------------------------------------------------------------------------------
@dataclass
class GRPOConfig:
    """Training configuration; field names and meanings follow TRL's `GRPOConfig`.

    Batch semantics. One optimizer step consumes
        per_device_train_batch_size × gradient_accumulation_steps × world_size   completions,
    that is that many / num_generations prompts, each sampled num_generations times. Those prompts
    are generated for once every num_iterations (μ) optimizer steps: the same generation batch serves
    all μ steps. `max_steps` counts optimizer steps, so a run makes max_steps / μ generation batches.
    """

    output_dir: str = field(default="grpo-output", metadata={"help": "Where metrics, checkpoints and the final model go."})
    # Optimization
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": "'linear' (decay to 0 at max_steps) or 'constant'."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm (0 = no clipping)."})
    max_steps: int = field(default=100, metadata={"help": "Number of optimizer steps."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Completions per forward/backward micro-batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    seed: int = field(default=42, metadata={"help": "Seed for prompt order and sampling."})
    # Generation
    num_generations: int = field(default=8, metadata={"help": "G: completions sampled per prompt (the group)."})
    max_prompt_length: int | None = field(default=512, metadata={"help": "Prompts are truncated from the left to this many tokens (None = no limit)."})
    max_completion_length: int = field(default=256, metadata={"help": "Maximum tokens generated per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs use the same one."})
    # GRPO objective
    num_iterations: int = field(default=1, metadata={"help": "μ: optimizer steps per generation batch."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping range: ratio >= 1 - epsilon."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clipping range: ratio <= 1 + epsilon_high (None = epsilon)."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient; 0 = no reference model at all."})
    loss_type: str = field(default="grpo", metadata={"help": "'grpo' (per-sequence mean), 'dapo' (per-token mean) or 'dr_grpo' (constant normalizer)."})
    scale_rewards: str = field(default="group", metadata={"help": "'group': divide advantages by the group's reward std; 'none' (Dr. GRPO): don't."})
    reward_weights: list[float] | None = field(default=None, metadata={"help": "One weight per reward function (None = all 1)."})
    # Speed and memory
    bf16: bool = field(default=False, metadata={"help": "bfloat16 autocast for every model call (fast on GPUs and on CPUs with AMX; slow on others)."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward to save memory (the training passes then stop sharing prompts)."})
    # Logging and saving
    logging_steps: int = field(default=10, metadata={"help": "Log averaged metrics every this many optimizer steps."})
    log_completions: bool = field(default=False, metadata={"help": "Print a few prompt/completion/reward rows at each log."})
    save_steps: int = field(default=500, metadata={"help": "Write a checkpoint every this many optimizer steps (and at the end)."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep at most this many checkpoints (None = all)."})

    def __post_init__(self):
        if isinstance(self.scale_rewards, bool):  # TRL's older boolean form
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        checks = [
            ("num_generations", self.num_generations >= 2, "must be >= 2: a group of one has no baseline"),
            ("num_iterations", self.num_iterations >= 1, "must be >= 1"),
            ("epsilon", 0 < self.epsilon < 1, "must lie in (0, 1)"),
            ("epsilon_high", self.epsilon_high > 0, "must be > 0"),
            ("beta", self.beta >= 0, "must be >= 0"),
            ("temperature", self.temperature > 0, "must be > 0"),
            ("learning_rate", self.learning_rate >= 0, "must be >= 0"),
            ("max_grad_norm", self.max_grad_norm >= 0, "must be >= 0"),
            ("max_steps", self.max_steps >= 1, "must be >= 1"),
            ("per_device_train_batch_size", self.per_device_train_batch_size >= 1, "must be >= 1"),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps >= 1, "must be >= 1"),
            ("max_completion_length", self.max_completion_length >= 1, "must be >= 1"),
            ("max_prompt_length", self.max_prompt_length is None or self.max_prompt_length >= 1, "must be >= 1 or None"),
            ("logging_steps", self.logging_steps >= 1, "must be >= 1"),
            ("save_steps", self.save_steps >= 1, "must be >= 1"),
            ("save_total_limit", self.save_total_limit is None or self.save_total_limit >= 1, "must be >= 1 or None"),
            ("loss_type", self.loss_type in ("grpo", "dapo", "dr_grpo"), "must be 'grpo', 'dapo' or 'dr_grpo'"),
            ("scale_rewards", self.scale_rewards in ("group", "none"), "must be 'group' or 'none'"),
            ("lr_scheduler_type", self.lr_scheduler_type in ("linear", "constant"), "must be 'linear' or 'constant'"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"GRPOConfig.{name}={getattr(self, name)!r} {rule}")


# ----------------------------------------------------------------------------------------------------
# 2. Generation: for each prompt q, sample G completions o_1..o_G ~ π_old(· | q)
# ----------------------------------------------------------------------------------------------------
def prompt_texts(tokenizer, prompts):
    """Plain-text prompts pass through; conversations go through the tokenizer's chat template."""
    if isinstance(prompts[0], str):
        return list(prompts)
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]


def tokenize_prompts(tokenizer, texts, max_prompt_length):
    """Left-truncate each prompt to max_prompt_length tokens and left-pad the batch, so that every
    completion starts at the same column, right after the real end of its prompt."""
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    if max_prompt_length is not None and any(len(x) > max_prompt_length for x in ids):
        warnings.warn(f"some prompts are longer than max_prompt_length={max_prompt_length} tokens; "
                      "they are truncated from the left (their beginning is dropped)", stacklevel=2)
        ids = [x[-max_prompt_length:] for x in ids]
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids])  # (B, P)
    attention_mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])       # (B, P)
    return input_ids, attention_mask


def position_ids(attention_mask):
    """Positions that count real tokens only, so that left padding shifts nothing. (B, T)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def completion_mask(completion_ids, eos_token_id):
    """1 for the tokens up to and including the first EOS, 0 after it. Position-based, not id-based,
    so the EOS itself stays trainable even when pad_token == eos_token."""
    is_eos = completion_ids == eos_token_id                                           # (B, C)
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1), is_eos.size(1))    # (B,)
    positions = torch.arange(is_eos.size(1), device=completion_ids.device)            # (C,)
    return (positions[None, :] <= first_eos[:, None]).long()                          # (B, C)


@torch.no_grad()
def generate_completions(model, tokenizer, prompt_ids, prompt_mask, args):
    """Sample num_generations completions per prompt, one token at a time with the KV cache, from exactly
    softmax(logits / temperature): no top-k, top-p or other sampling default of the model, so that the
    log-probs of section 4 describe the distribution that sampled. Returns the prompts repeated G times
    (B·G, P), the completions (B·G, C) with padding after each one's EOS, and their mask."""
    G, C = args.num_generations, args.max_completion_length
    # Prefill once per prompt, not once per completion: the G completions of a prompt share its KV cache.
    positions = position_ids(prompt_mask)                               # (B, P)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache = out.cache
    cache.batch_repeat_interleave(G)
    logits = out.logits[:, -1].repeat_interleave(G, 0)                  # (B·G, V): next-token logits
    mask = prompt_mask.repeat_interleave(G, 0)                          # (n, P + t): n rows still sampling
    position = positions[:, -1:].repeat_interleave(G, 0)                # (n, 1)
    rows = torch.arange(len(mask), device=mask.device)                  # (n,): which completion each row is
    completion_ids = torch.full((len(mask), C), tokenizer.pad_token_id, device=mask.device)  # (B·G, C)
    for t in range(C):
        token = sample_token(logits, args.temperature)                  # (n,)
        completion_ids[rows, t] = token
        going = token != tokenizer.eos_token_id
        if t == C - 1 or not going.any():
            break
        if not going.all():  # finished completions leave the batch: no compute is spent on their padding
            rows, token, mask, position = rows[going], token[going], mask[going], position[going]
            cache.batch_select_indices(going.nonzero().squeeze(1))
        mask, position = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), position + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position, cache=cache,
                       use_cache=True).logits[:, -1]                   # (n, V)
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion_ids,
            completion_mask(completion_ids, tokenizer.eos_token_id))


def sample_token(logits, temperature):
    """One token per row from softmax(logits / temperature), by inverse CDF: a uniform number per row,
    located in the cumulative probabilities (float64, so that rare tokens keep their exact share).
    torch.multinomial draws one random number per vocabulary entry: 4× slower on this project's CPU."""
    cdf = (logits.float() / temperature).softmax(-1).double().cumsum(-1)           # (n, V)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]  # (n, 1)
    return torch.searchsorted(cdf, u).squeeze(1).clamp(max=cdf.size(1) - 1)         # (n,)


# ----------------------------------------------------------------------------------------------------
# 3. Rewards and group-normalized advantages
# ----------------------------------------------------------------------------------------------------
def score_completions(reward_funcs, prompts, completions, completion_ids, columns):
    """Call each reward function TRL-style, f(prompts=..., completions=..., completion_ids=..., **columns),
    and check what it returns: one number (or None = "does not apply") per completion. (N, F), NaN for None."""
    per_func = []
    for f in reward_funcs:
        name = getattr(f, "__name__", repr(f))
        try:
            values = f(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        if not hasattr(values, "__len__") or len(values) != len(completions):
            got = len(values) if hasattr(values, "__len__") else type(values).__name__
            raise ValueError(f"reward function {name!r} returned {got} values for {len(completions)} completions; "
                             "it must return one number (or None) per completion")
        column = []
        for i, v in enumerate(values):
            is_number = isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1)
            if v is not None and (isinstance(v, bool) or not is_number):
                raise TypeError(f"reward function {name!r} returned {v!r} ({type(v).__name__}) for completion {i}; "
                                "rewards must be numbers (or None)")
            v = math.nan if v is None else float(v)
            if math.isinf(v) or (math.isnan(v) and values[i] is not None):
                raise ValueError(f"reward function {name!r} returned {v} for completion {i} "
                                 f"({completions[i]!r:.80}); rewards must be finite (use None for 'does not apply')")
            column.append(v)
        per_func.append(column)
    rewards_per_func = torch.tensor(per_func, dtype=torch.float32).T  # (N, F)
    unscored = rewards_per_func.isnan().all(1)
    if unscored.any():
        i = int(unscored.nonzero()[0])
        raise ValueError(f"every reward function returned None for completion {i} ({completions[i]!r:.80}); "
                         "at least one must score each completion")
    return rewards_per_func


def group_advantages(rewards, num_generations, scale_rewards="group"):
    """A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4); with scale_rewards='none' (Dr. GRPO) the
    division is dropped. Completions of one prompt are adjacent: rows [k·G, (k+1)·G) form group k."""
    grouped = rewards.view(-1, num_generations)                               # (B, G)
    advantages = grouped - grouped.mean(1, keepdim=True)                      # (B, G)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    # A group whose rewards are all equal carries no signal: its advantage is exactly 0 (the float mean
    # of equal numbers can differ from them in the last bit).
    all_equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return advantages.masked_fill(all_equal, 0.0).view(-1)                    # (B·G,)


# ----------------------------------------------------------------------------------------------------
# 4. Per-token log-probs: log π(o_t | q, o_<t) for the completion tokens only
# ----------------------------------------------------------------------------------------------------
def per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature,
                    chunk_tokens=256):
    """Log-probs (b, C) of the completion tokens under `model`, from logits divided by the sampling
    temperature (so that π_old is the distribution that sampled).

    Compute: consecutive rows with the same prompt (a group's G completions) run that prompt through
    the decoder once; their completion tokens attend to its keys and values through the KV cache,
    gradient included: B·P + B·G·C tokens instead of B·G·(P + C), 44 % fewer for P = C = 64, G = 8.
    Gradient checkpointing re-runs each layer in backward, which a KV cache cannot survive: with it
    on, each row runs its prompt and completion in one pass.

    Memory: the (b, C, V) logits are the largest tensor of GRPO on a small model (8 × 64 × 49152 floats
    = 100 MB, and backward needs two more of that size). Here they never exist: the hidden states go
    through the LM head `chunk_tokens` tokens at a time (TokenLogps), so forward and backward hold one
    chunk of logits at a time, at the price of running the LM head twice. log p = logit - logsumexp
    also avoids a full log_softmax tensor. This assumes logits = lm_head(hidden); GRPOTrainer checks
    that for its model."""
    P, decoder = prompt_ids.size(1), model.get_decoder()
    mask = torch.cat([prompt_mask, completion_mask], 1)                                     # (b, P+C)
    positions = position_ids(mask)                                                          # (b, P+C)
    if model.is_activation_checkpointing:
        hidden = decoder(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                         position_ids=positions, use_cache=False).last_hidden_state[:, P - 1:-1]  # (b, C, H)
    else:
        # A row starts a new prompt where its prompt differs from the row above it.
        new = torch.ones(len(prompt_ids), dtype=torch.bool, device=prompt_ids.device)     # (b,)
        new[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1)
        prompt_of = new.cumsum(0) - 1                                   # (b,): each row's prompt among the new
        prompt = decoder(input_ids=prompt_ids[new], attention_mask=prompt_mask[new],
                         position_ids=positions[new, :P], use_cache=True)
        prompt.cache.batch_select_indices(prompt_of)                   # (b, heads, P, d) keys and values
        rest = decoder(input_ids=completion_ids, attention_mask=mask, position_ids=positions[:, P:],
                       cache=prompt.cache, use_cache=True).last_hidden_state
        # The prompt's last state predicts completion token 0; completion token t's state predicts t+1.
        hidden = torch.cat([prompt.last_hidden_state[prompt_of, -1:], rest[:, :-1]], 1)  # (b, C, H)
    hidden = hidden.flatten(0, 1)                              # (b·C, H): the state at t predicts token t+1
    lm_head = model.get_output_embeddings()
    chunks = [TokenLogps.apply(h, y, temperature, lm_head.weight, lm_head.bias)
              for h, y in zip(hidden.split(chunk_tokens), completion_ids.flatten().split(chunk_tokens))]
    return torch.cat(chunks).view_as(completion_ids)                                        # (b, C)


class TokenLogps(torch.autograd.Function):
    """log π(y) = z_y - logsumexp(z) with z = (h Wᵀ + b) / T, for one chunk of n tokens. Forward keeps h
    and logsumexp(z), never the (n, V) logits; backward computes them again and turns them, in place,
    into the gradient of a log-softmax:  ∂ log π(y) / ∂z = onehot(y) - softmax(z)."""

    @staticmethod
    def forward(ctx, hidden, targets, temperature, weight, bias):             # hidden (n, H), targets (n,)
        dev = hidden.device.type  # bf16 autocast, if on, must run the head in backward as in forward
        ctx.autocast = dict(device_type=dev, dtype=torch.get_autocast_dtype(dev), enabled=torch.is_autocast_enabled(dev))
        logits = F.linear(hidden, weight, bias).float().div_(temperature)                     # (n, V): z
        lse = logits.logsumexp(-1)                                                              # (n,)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.temperature = temperature
        return logits.gather(-1, targets[:, None]).squeeze(-1) - lse                            # (n,)

    @staticmethod
    def backward(ctx, grad):                                                  # grad (n,): ∂loss / ∂log π(y)
        hidden, targets, weight, bias, lse = ctx.saved_tensors
        with torch.autocast(**ctx.autocast):
            logits = F.linear(hidden, weight, bias).float()                                     # (n, V)
        grad_z = logits.div_(ctx.temperature).sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax(z)·grad
        grad_z.scatter_add_(1, targets[:, None], grad[:, None])                    # + onehot(y)·grad
        grad_logits = grad_z.div_(ctx.temperature).to(weight.dtype)                # ∂z/∂logits = 1/T
        grad_weight = grad_logits.T @ hidden.to(weight.dtype) if ctx.needs_input_grad[3] else None
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[4] else None
        return (grad_logits @ weight).to(hidden.dtype), None, None, grad_weight, grad_bias


# ----------------------------------------------------------------------------------------------------
# 5. The clipped objective, for one micro-batch
# ----------------------------------------------------------------------------------------------------
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, args, num_seqs, num_tokens):
    """The GRPO objective (negated, to minimize) for one micro-batch of completions.

    logps, old_logps, ref_logps, mask: (b, C); advantages: (b,). `num_seqs` and `num_tokens` count the
    completions and completion tokens of the whole optimizer step (over all micro-batches and ranks),
    so that the micro-batch losses add up to the loss of the whole batch taken at once."""
    A = advantages[:, None]                                                    # (b, 1): one A per sequence
    coef_1 = torch.exp(logps - old_logps)                                      # importance ratio π_θ / π_old
    coef_2 = torch.clamp(coef_1, 1 - args.epsilon, 1 + args.epsilon_high)      # clipped ratio
    per_token_loss = -torch.min(coef_1 * A, coef_2 * A)                        # -min(ratio·A, clip(ratio)·A)
    if args.beta > 0:                                                          # + β · KL_k3(π_θ ‖ π_ref)
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # k3 estimator, >= 0
        per_token_loss = per_token_loss + args.beta * per_token_kl
    # Reduction over tokens and sequences: the sum over this micro-batch, divided by a normalizer that
    # spans the whole optimizer step (gradient accumulation then adds up to the whole-batch gradient).
    if args.loss_type == "grpo":     # paper: mean over each sequence's tokens, then mean over sequences
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    elif args.loss_type == "dapo":   # DAPO: mean over all tokens of the step (long answers weigh more)
        loss = (per_token_loss * mask).sum() / num_tokens
    else:                            # Dr. GRPO: constant normalizer, no length bias at all
        loss = (per_token_loss * mask).sum() / (num_seqs * args.max_completion_length)
    # Sums for the metrics: clipped tokens (sign-aware: only where the clip removes the gradient), KL.
    with torch.no_grad():
        stats = {"clip_low": ((coef_1 < 1 - args.epsilon) & (A < 0) & (mask > 0)).sum(),
                 "clip_high": ((coef_1 > 1 + args.epsilon_high) & (A > 0) & (mask > 0)).sum()}
        if args.beta > 0:
            stats["kl"] = (per_token_kl * mask).sum()
    return loss, stats


# ----------------------------------------------------------------------------------------------------
# 6. The μ-iteration loop
# ----------------------------------------------------------------------------------------------------
def micro_batches(batch, size):
    """Split a generation batch into micro-batches of `size` completions, each trimmed to its longest
    completion and its longest prompt (padding columns cost compute and change nothing)."""
    for start in range(0, batch["completion_mask"].size(0), size):
        rows = slice(start, start + size)
        c = int(batch["completion_mask"][rows].sum(1).max())       # longest real completion here
        p = int(batch["prompt_mask"][rows].sum(1).max())           # longest real prompt here
        mb = {k: v[rows] if v.dim() else v for k, v in batch.items()}  # 0-dim: the step's normalizers
        for k in ("prompt_ids", "prompt_mask"):
            mb[k] = mb[k][:, mb[k].size(1) - p:]
        for k in ("completion_ids", "completion_mask", "old_logps", "ref_logps"):
            if k in mb:
                mb[k] = mb[k][:, :c]
        yield mb


class GRPOTrainer:
    """TRL-style trainer: GRPOTrainer(model, reward_funcs, args, train_dataset).train().

    model: a hub id, a local path or a PreTrainedModel (causal LM). reward_funcs: one function or a list,
    f(prompts, completions, **kwargs) -> list of floats (None = does not apply). train_dataset: a
    `datasets.Dataset` with a "prompt" column (text, or a conversation as a list of role/content
    messages); its other columns reach the reward functions as keyword lists."""

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, processing_class=None):
        self.args = args = args if args is not None else GRPOConfig()
        # Data parallelism under torchrun: every rank runs this same program on its own share of prompts.
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")

        # Fail fast on everything that can be checked before loading a model.
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if per_step % args.num_generations:
            raise ValueError(f"per_device_train_batch_size × gradient_accumulation_steps = {per_step} completions "
                             f"per optimizer step (per device) is not divisible by num_generations="
                             f"{args.num_generations}; each prompt's whole group must be in the same step")
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not self.reward_funcs or not all(callable(f) for f in self.reward_funcs):
            raise TypeError(f"reward_funcs must be a function or a non-empty list of functions, got {reward_funcs!r}")
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ValueError(f"GRPOConfig.reward_weights has {len(weights)} weights for {len(self.reward_funcs)} "
                             "reward functions; give one weight per function")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        self.dataset = check_dataset(train_dataset)

        # Policy π_θ, tokenizer and, only when β > 0, the frozen reference policy π_ref.
        self.model = load_model(model).to(self.device)
        for module in self.model.modules():  # no dropout: the same weights must give the same log-probs
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        if args.gradient_checkpointing:
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.tokenizer = load_tokenizer(processing_class, self.model)
        check_logits_are_lm_head(self.model, self.tokenizer)
        self.ref_model = None
        if args.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

        # fused: one kernel over all parameters, no temporaries of the model's size (CPU and GPU).
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.learning_rate,
                                           weight_decay=args.weight_decay, fused=True)
        decay = (lambda s: 1 - s / args.max_steps) if args.lr_scheduler_type == "linear" else (lambda s: 1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, decay)
        self.prompts_per_step = per_step // args.num_generations           # this rank's prompts per step
        self.step = 0
        self.batch = None           # the cached generation batch of the current μ cycle
        self.should_stop = False    # set by a subclass's log() to end training early
        self.nonfinite_in_a_row = 0

    # -- autocast for every model call when bf16 is on; a clock that waits for the GPU -------------------
    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.args.bf16 else nullcontext()

    def clock(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- Sections 2-5 for one generation batch ---------------------------------------------------------
    def generation_batch_prompts(self, k):
        """Dataset rows of generation batch k for this rank. The order is a seeded permutation per epoch,
        the same on every rank and a pure function of k, so a resumed run picks up the same prompts."""
        n, per_rank = len(self.dataset), self.prompts_per_step
        first = (k * self.world_size + self.rank) * per_rank
        rows = []
        for i in range(first, first + per_rank):
            epoch, j = divmod(i, n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.args.seed + epoch))
            rows.append(int(perm[j]))
        return rows

    def generate_and_score(self, k):
        """Generate, score and cache everything the μ optimizer steps of generation batch k need."""
        args, t0 = self.args, self.clock()
        rows = self.dataset.select(self.generation_batch_prompts(k)).to_dict()  # {column: [values]}
        prompts = rows["prompt"]
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompt_texts(self.tokenizer, prompts),
                                                   args.max_prompt_length)
        with self.autocast():
            prompt_ids, prompt_mask, completion_ids, mask = generate_completions(
                self.model, self.tokenizer, prompt_ids.to(self.device), prompt_mask.to(self.device), args)
        t_gen = self.clock() - t0

        # Rewards: the reward functions see text, each prompt repeated G times next to its completions.
        G = args.num_generations
        ids = [row[:n].tolist() for row, n in zip(completion_ids, mask.sum(1))]  # each up to its first EOS
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        conversational = not isinstance(prompts[0], str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        repeat = lambda xs: [x for x in xs for _ in range(G)]
        columns = {c: repeat(v) for c, v in rows.items() if c != "prompt"}
        rewards_per_func = score_completions(self.reward_funcs, repeat(prompts), completions, ids, columns)  # (N, F)
        rewards = (rewards_per_func * self.reward_weights).nansum(1)                                   # (N,)

        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": mask,
                 "advantages": group_advantages(rewards, G, args.scale_rewards).to(self.device)}
        # Normalizers of the loss: they span the whole optimizer step, on every rank.
        batch["num_seqs"] = self.all_reduce(torch.tensor(float(mask.size(0)), device=self.device))
        batch["num_tokens"] = self.all_reduce(mask.sum().float())

        # Cached log-probs, once per generation batch: π_old only when μ > 1 (with μ = 1 the training
        # forward's own detached log-probs are π_old), π_ref only when β > 0.
        t1 = self.clock()
        if args.num_iterations > 1:
            batch["old_logps"] = self.batch_logps(self.model, batch)
        if args.beta > 0:
            batch["ref_logps"] = self.batch_logps(self.ref_model, batch)
        stats = {"reward": rewards.mean(), "reward_std": rewards.view(-1, G).std(1).mean(),
                 "completion_length": mask.sum(1).float().mean()}
        stats.update({f"rewards/{getattr(f, '__name__', i)}": rewards_per_func[:, i].nanmean()
                      for i, f in enumerate(self.reward_funcs)})
        stats = {k: float(self.all_reduce(v.to(self.device))) / self.world_size for k, v in stats.items()}
        self.samples = list(zip(repeat(prompts), texts, rewards.tolist()))
        return batch, {**stats, "time_generate": t_gen, "time_logps": self.clock() - t1}

    @torch.no_grad()
    def batch_logps(self, model, batch):
        """Log-probs of every completion token of a generation batch, micro-batch by micro-batch with the
        same shapes as the training passes (so that the first step's ratio is exactly 1). (N, C)."""
        out = torch.zeros(batch["completion_ids"].shape, device=self.device)
        for i, mb in enumerate(micro_batches(batch, self.args.per_device_train_batch_size)):
            c, b0 = mb["completion_ids"].size(1), i * self.args.per_device_train_batch_size
            with self.autocast():
                out[b0:b0 + len(mb["completion_ids"]), :c] = per_token_logps(
                    model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"],
                    self.args.temperature)
        return out

    # -- One optimizer step on the cached generation batch ---------------------------------------------
    def optimizer_step(self, batch):
        args = self.args
        sums = defaultdict(float)
        for mb in micro_batches(batch, args.per_device_train_batch_size):
            t0 = self.clock()
            with self.autocast():
                logps = per_token_logps(self.model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                        mb["completion_mask"], args.temperature)
            old_logps = mb["old_logps"] if args.num_iterations > 1 else logps.detach()
            loss, stats = grpo_loss(logps, old_logps, mb.get("ref_logps"), mb["advantages"], mb["completion_mask"],
                                    args, batch["num_seqs"], batch["num_tokens"])
            t1 = self.clock()
            loss.backward()
            sums["time_forward"] += t1 - t0
            sums["time_backward"] += self.clock() - t1
            sums["loss"] += loss.item()
            for k, v in stats.items():
                sums[k] += v.item()
        t2 = self.clock()
        # Data parallelism: each rank's loss was divided by the global normalizers, so the sum of the
        # ranks' gradients is the gradient of the whole step (this all-reduce is what DDP does).
        for p in self.model.parameters():
            if p.grad is not None:
                self.all_reduce(p.grad)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm or math.inf)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_a_row = 0
        else:  # a NaN/inf anywhere in the loss or gradient: skip, weights and optimizer state untouched
            self.nonfinite_in_a_row += 1
            warnings.warn(f"step {self.step + 1}: non-finite loss or gradient norm ({grad_norm}); step skipped "
                          f"({self.nonfinite_in_a_row} in a row)", stacklevel=2)
        sums["time_optimizer"] = self.clock() - t2
        self.optimizer.zero_grad(set_to_none=True)
        # Loss, clip counts and KL are summed over ranks; the seconds stay this rank's own.
        metrics = {k: v if k.startswith("time") else float(self.all_reduce(torch.tensor(v, device=self.device)))
                   for k, v in sums.items()}
        n_tok = float(batch["num_tokens"])
        metrics.update(grad_norm=float(grad_norm), learning_rate=self.scheduler.get_last_lr()[0],
                       clip_ratio_low=metrics.pop("clip_low") / n_tok, clip_ratio_high=metrics.pop("clip_high") / n_tok,
                       nonfinite_steps=float(not torch.isfinite(grad_norm)))
        if "kl" in metrics:
            metrics["kl"] /= n_tok
        return metrics

    # -- The loop ---------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None):
        """generate -> score -> cache -> μ optimizer steps, until max_steps optimizer steps."""
        args, mu = self.args, self.args.num_iterations
        if resume_from_checkpoint:
            self.load_checkpoint(resume_from_checkpoint)
        else:
            random.seed(args.seed + self.rank)
            torch.manual_seed(args.seed + self.rank)  # same prompts on every rank, different samples
        window = defaultdict(list)
        self.start_time = time.perf_counter()
        try:
            rng_at_last_step = rng_state()  # what a checkpoint of the last finished step must hold
            while self.step < args.max_steps and not self.should_stop:
                metrics = {"time_generate": 0.0, "time_logps": 0.0}  # stays 0 on the μ - 1 reuse steps
                if self.step % mu == 0:                                    # a new generation batch
                    self.batch, batch_stats = self.generate_and_score(self.step // mu)
                    metrics.update(batch_stats)
                metrics.update(self.optimizer_step(self.batch))           # one of the μ optimizer steps
                for k, v in metrics.items():
                    window[k].append(v)
                self.step += 1
                rng_at_last_step = rng_state()
                if self.nonfinite_in_a_row >= 3:
                    self.save_checkpoint()
                    raise RuntimeError(f"training stopped at step {self.step}: {self.nonfinite_in_a_row} optimizer "
                                       "steps in a row had a non-finite loss or gradient (check the rewards, lower "
                                       "the learning rate, or turn bf16 off); a checkpoint was written")
                if self.step % args.logging_steps == 0 or self.step == args.max_steps:
                    self.log({"step": self.step, **{k: sum(v) / len(v) for k, v in window.items()},
                              "elapsed": time.perf_counter() - self.start_time})
                    window.clear()
                    # log() may ask to stop (a target reached, a time budget spent): all ranks stop together.
                    self.should_stop = bool(self.all_reduce(torch.tensor(float(self.should_stop), device=self.device)))
                if self.step % args.save_steps == 0 and self.step < args.max_steps:
                    self.save_checkpoint()
        except KeyboardInterrupt:  # checkpoint the last finished step, as if the current one never began
            set_rng_state(rng_at_last_step)
            self.save_checkpoint()
            raise
        self.save_checkpoint()
        if self.rank == 0:
            self.model.save_pretrained(args.output_dir)
            self.tokenizer.save_pretrained(args.output_dir)
        return self

    def log(self, metrics):
        """Print one line and append it to output_dir/metrics.jsonl (rank 0). Override to hook in."""
        if self.rank != 0:
            return
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(metrics) + "\n")
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
        if self.args.log_completions:
            for prompt, completion, reward in self.samples[:4]:
                prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # a conversation's last turn
                print(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")

    def all_reduce(self, t):
        """Sum a tensor over ranks (a no-op in a single process)."""
        if self.world_size > 1:
            dist.all_reduce(t)
        return t

    # ------------------------------------------------------------------------------------------------
    # 7. Checkpoints: output_dir/checkpoint-<step>, written atomically, resumed bit-identically on CPU
    # ------------------------------------------------------------------------------------------------
    def save_checkpoint(self):
        """Model, optimizer, scheduler, step and, from every rank, its RNG states and, mid-μ-cycle, its
        cached generation batch (so a resumed run continues the cycle instead of regenerating)."""
        mine = {"rng": rng_state(), "samples": getattr(self, "samples", None),
                "batch": self.batch if self.step % self.args.num_iterations else None}
        ranks = [mine]
        if self.world_size > 1:
            ranks = [None] * self.world_size
            dist.all_gather_object(ranks, mine)
        if self.rank == 0:
            final = os.path.join(self.args.output_dir, f"checkpoint-{self.step}")
            tmp = final + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.model.save_pretrained(tmp)
            state = {"step": self.step, "optimizer": self.optimizer.state_dict(), "ranks": ranks,
                     "scheduler": self.scheduler.state_dict(), "nonfinite_in_a_row": self.nonfinite_in_a_row,
                     "shape": self.checkpoint_shape()}
            torch.save(state, os.path.join(tmp, "trainer_state.pt"))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)  # atomic: a checkpoint folder is either complete or absent
            if self.args.save_total_limit is not None:
                for old in list_checkpoints(self.args.output_dir)[:-self.args.save_total_limit]:
                    shutil.rmtree(old)
        if self.world_size > 1:
            dist.barrier()  # no rank goes on (or resumes) before the checkpoint exists

    def checkpoint_shape(self):
        a = self.args
        return {"num_iterations": a.num_iterations, "num_generations": a.num_generations, "world_size": self.world_size,
                "per_device_train_batch_size": a.per_device_train_batch_size,
                "gradient_accumulation_steps": a.gradient_accumulation_steps}

    def load_checkpoint(self, path):
        if path is True:
            found = list_checkpoints(self.args.output_dir)
            if not found:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir!r} holds no checkpoint-<step> folder")
            path = found[-1]
        state_file = os.path.join(path, "trainer_state.pt")
        if not os.path.isfile(state_file):
            raise ValueError(f"resume_from_checkpoint={path!r} is not a checkpoint: no trainer_state.pt in it")
        state = torch.load(state_file, map_location=self.device, weights_only=False)
        if state["shape"] != self.checkpoint_shape():
            diff = {k: (v, self.checkpoint_shape()[k]) for k, v in state["shape"].items() if self.checkpoint_shape()[k] != v}
            raise ValueError(f"checkpoint {path!r} was written with a different batch shape (checkpoint, now): {diff}")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=next(self.model.parameters()).dtype)
        self.model.load_state_dict(loaded.state_dict())
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.nonfinite_in_a_row = state["step"], state["nonfinite_in_a_row"]
        mine = state["ranks"][self.rank]
        self.batch, self.samples = mine["batch"], mine["samples"]
        set_rng_state(mine["rng"])


def rng_state():
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def list_checkpoints(output_dir):
    """Complete checkpoint folders in output_dir, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    names = [n for n in os.listdir(output_dir) if n.startswith("checkpoint-") and n[len("checkpoint-"):].isdigit()]
    return [os.path.join(output_dir, n) for n in sorted(names, key=lambda n: int(n.split("-")[1]))]


# ----------------------------------------------------------------------------------------------------
# Loading and checking inputs
# ----------------------------------------------------------------------------------------------------
def load_model(model):
    if isinstance(model, PreTrainedModel):
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a hub id, a local path or a PreTrainedModel, got {type(model).__name__}")
    return from_disk_or_hub(AutoModelForCausalLM, str(model), dtype=torch.float32)


def load_tokenizer(processing_class, model):
    tokenizer = processing_class or from_disk_or_hub(AutoTokenizer, model.config._name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token, so completions could never end; set tokenizer.eos_token")
    if tokenizer.pad_token_id is None:  # padding is masked out, so any id will do; EOS is the usual choice
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_disk_or_hub(cls, name, **kwargs):
    """cls.from_pretrained(name), but when the hub is unreachable it looks in the local cache only, so
    that a wrong name fails within seconds instead of after minutes of network retries."""
    if not os.path.isdir(name) and (os.path.isabs(name) or name.startswith(".")):
        raise ValueError(f"could not load {name!r}: there is no such folder")
    offline = not os.path.isdir(name) and not hub_reachable()
    try:
        return cls.from_pretrained(name, local_files_only=offline, **kwargs)
    except OSError as e:
        where = ("the hub is unreachable from here and it is not in the local cache" if offline else
                 "it is neither a local folder nor a model on the hub" if not os.path.isdir(name) else
                 "the folder holds no model of this kind")
        raise ValueError(f"could not load {name!r}: {where} ({str(e).splitlines()[0]})") from e


def hub_reachable(timeout=3.0):
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    host = urllib.parse.urlparse(huggingface_hub.constants.ENDPOINT).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


@torch.no_grad()
def check_logits_are_lm_head(model, tokenizer):
    """per_token_logps computes logits as lm_head(last hidden state), as Llama, Qwen, Mistral or SmolLM do;
    refuse a model that post-processes them (Gemma 2's softcapping, Cohere's scaling)."""
    ids = torch.tensor([[tokenizer.eos_token_id] * 3], device=model.device)
    full = model(input_ids=ids).logits
    lean = model.get_output_embeddings()(model.get_decoder()(input_ids=ids).last_hidden_state)
    if not torch.allclose(full, lean, rtol=1e-3, atol=1e-3):
        raise ValueError(f"{type(model).__name__}'s logits are not lm_head(hidden states) (softcapping or scaling?); "
                         "per_token_logps would compute wrong log-probs for it")


def check_dataset(dataset):
    """A datasets.Dataset, or a list of rows such as [{"prompt": ..., "answer": ...}], with valid prompts."""
    if isinstance(dataset, list):
        if not all(isinstance(row, dict) and "prompt" in row for row in dataset):
            raise ValueError("train_dataset as a list must hold rows like {'prompt': ...}, each with a 'prompt' key")
        prompts = [row["prompt"] for row in dataset]
    elif hasattr(dataset, "column_names"):
        if "prompt" not in dataset.column_names:
            raise ValueError(f"train_dataset has no 'prompt' column (columns: {dataset.column_names})")
        prompts = dataset["prompt"]
    else:
        raise TypeError(f"train_dataset must be a datasets.Dataset with a 'prompt' column, got {type(dataset).__name__}")
    if len(prompts) == 0:
        raise ValueError("train_dataset is empty")
    kinds = set()
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p.strip():
                raise ValueError(f"train_dataset prompt {i} is an empty string")
            kinds.add("text")
        elif isinstance(p, list) and p and all(isinstance(m, dict) and "role" in m and "content" in m for m in p):
            kinds.add("conversation")
        else:
            raise ValueError(f"train_dataset prompt {i} is neither text nor a conversation "
                             f"(a list of {{'role', 'content'}} messages): {p!r:.80}")
        if len(kinds) > 1:
            raise ValueError(f"train_dataset's prompt column mixes plain text and conversations (prompt {i}); use one kind")
    return Dataset.from_list(dataset) if isinstance(dataset, list) else dataset
