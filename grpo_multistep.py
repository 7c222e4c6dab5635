"""
GRPO with multi-step (μ) optimization, in one file: the idea of TRL PR #2899, "6x faster GRPO with
multi-step optimization", written from scratch to be read.

GRPO (DeepSeekMath's Algorithm 1) trains a language model on rewards. For each prompt q it samples a
group of G completions o_1..o_G from the current policy π_old, scores them, and gives every token of o_i
the advantage A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + 1e-4). The multi-step trick reuses one
batch of generations for μ = `num_iterations` optimizer steps. After the first, π_θ is no longer π_old,
so the loss carries PPO's clipped importance ratio against π_old's log-probs, computed once and cached:

    coef_1 = π_θ(o_t) / π_old(o_t) = exp(logp - old_logp),    coef_2 = clamp(coef_1, 1 - ε, 1 + ε_high)
    loss_t = -min(coef_1 · A, coef_2 · A) + β · KL_t(π_θ ‖ π_ref)

A generation batch may also hold S > 1 optimizer steps' worth of completions (TRL's steps_per_generation);
each of its S mini-batches is then used μ times, so that μ·S optimizer steps share one generation. With
μ·S = 1, π_θ *is* π_old: old_logp = logp.detach(), no extra forward pass, and the gradient is exactly
that of the single-step GRPO loss -exp(logp - logp.detach()) · A. With μ·S > 1 the batch's first step still
has ρ = 1; every later one (a reuse with μ > 1, a stale mini-batch with S > 1) is off-policy and clipped.

Part I is the algorithm, in the order of Algorithm 1; Part II, the engineering it calls in one line each.
Left out on purpose: vLLM and `model.generate` (a plain loop samples exactly what the log-probs describe),
DeepSpeed and FSDP (all-reduce serves models that fit a GPU), warmup, Algorithm 1's π_ref ← π_θ resets.
"""
import atexit, copy, functools, importlib.util, itertools, json, math, numbers, os, random, shutil, signal
import pathlib, re, sys, tempfile, threading, time, typing, warnings
from collections import abc, defaultdict
from contextlib import ExitStack, contextmanager, nullcontext, suppress
from dataclasses import asdict, dataclass, field

import huggingface_hub, numpy, safetensors.torch, torch, torch.distributed as dist, torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

# ======================================== PART I: THE ALGORITHM ========================================
# ---- 1. Config ---------------------------------------------------------------------------------------
def arg(default, help):  # a field and its --help text (train_tldr.py makes every field a flag)
    return field(default=default, metadata={"help": help})

@dataclass
class GRPOConfig:
    """TRL's names. An optimizer step takes per_device_train_batch_size × gradient_accumulation_steps ×
    world_size completions (/ G prompts). A generation batch, steps_per_generation micro-batches, holds S =
    steps_per_generation / gradient_accumulation_steps steps' worth, each used μ = num_iterations times."""
    output_dir: str = arg("grpo-output", "Where metrics, checkpoints and the final model go.")
    overwrite_output_dir: bool = arg(False, "Start afresh over another run (deleting its files, no other).")
    learning_rate: float = arg(1e-6, "AdamW learning rate.")
    weight_decay: float = arg(0.0, "AdamW weight decay.")
    lr_scheduler_type: str = arg("linear", "'linear' (decay to 0 at max_steps) or 'constant'.")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0 = no clipping).")
    max_steps: int = arg(100, "Number of optimizer steps.")
    per_device_train_batch_size: int = arg(8, "Completions per forward/backward micro-batch.")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.")
    seed: int = arg(42, "Seed for prompt order and sampling.")
    num_generations: int = arg(8, "G: completions sampled per prompt (the group).")
    max_prompt_length: int | None = arg(512, "Prompts keep their last this many tokens (None: all).")
    max_completion_length: int = arg(256, "Maximum tokens generated per completion.")
    temperature: float = arg(1.0, "Sampling temperature; log-probs use the same one.")
    num_iterations: int = arg(1, "μ: optimizer steps on each mini-batch of a generation batch.")
    steps_per_generation: int | None = arg(None, "Micro-batches per generation batch (None: one step's).")
    epsilon: float = arg(0.2, "Lower clipping range: ratio >= 1 - epsilon.")
    epsilon_high: float | None = arg(None, "Upper clipping range: ratio <= 1 + epsilon_high (None: epsilon).")
    beta: float = arg(0.0, "KL coefficient; 0 = no reference model at all.")
    use_bias_correction_kl: bool = arg(False, "Weigh the KL term by the ratio ρ (TRL 1.16's default: True).")
    loss_type: str = arg("grpo", "'grpo' (sequence mean), 'bnpo' (TRL PR #2899's), 'dapo' or 'dr_grpo'.")
    importance_sampling_level: str = arg("token", "ρ per 'token', or per 'sequence' (GSPO).")
    mask_truncated_completions: bool = arg(False, "No loss on completions cut at max_completion_length.")
    scale_rewards: str = arg("group", "'group': divide advantages by the group's reward std; 'none': don't.")
    reward_weights: list[float] | None = arg(None, "One weight per reward function (None = all 1).")
    model_init_kwargs: dict | str | None = arg(None, "from_pretrained's kwargs (JSON too); default float32.")
    bf16: bool = arg(False, "bfloat16 autocast for every model call (fast on GPUs, emulated on most CPUs).")
    gradient_checkpointing: bool = arg(False, "Recompute activations in backward: less memory, more time.")
    logging_steps: int = arg(10, "Log averaged metrics every this many optimizer steps.")
    log_completions: bool = arg(False, "Print a few prompt/completion/reward rows at each log.")
    save_steps: int = arg(500, "Write a checkpoint every this many optimizer steps (and at the end).")
    save_total_limit: int | None = arg(None, "Keep at most this many checkpoints (None = all).")

    def __post_init__(self):  # strings converted as HfArgumentParser does; types and ranges (Part II)
        check_config(self)

def mini_batches_per_generation(args):  # S: optimizer steps' worth of completions in a generation batch
    return (args.steps_per_generation or args.gradient_accumulation_steps) // args.gradient_accumulation_steps

# ---- 2. Generation: for each prompt q, sample G completions o_1..o_G ~ π_old(· | q) ------------------
def tokenize_prompts(tokenizer, prompts, max_prompt_length):
    """Text, with the tokenizer's special tokens (BOS) as in TRL, or conversations through the chat template
    (which writes its own); each cut to its last max_prompt_length tokens and left-padded, so that every
    completion starts at one column, right after the end of its prompt."""
    chat = not isinstance(prompts[0], str)
    if chat:  # a list of conversations renders as a list of strings
        prompts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
    ids = check_prompt_ids(tokenizer(prompts, add_special_tokens=not chat)["input_ids"], max_prompt_length)
    padded = tokenizer.pad({"input_ids": ids}, padding_side="left", return_attention_mask=True,
                           return_tensors="pt")
    return padded["input_ids"], padded["attention_mask"]                                   # (B, P) each

def position_ids(attention_mask):  # positions that count real tokens only: left padding shifts nothing
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)                               # (B, T)

def completion_mask(completion_ids, eos_token_ids):
    """1 up to and including the first EOS (any of eos_token_ids), 0 after: by position, not by id, so that
    the EOS stays trainable when pad_token == eos_token."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_token_ids, device=completion_ids.device)).long()
    return (is_eos.cumsum(1) - is_eos == 0).long()  # (B, C): 1 where no EOS came before (the first is kept)

def sample_token(logits, temperature):  # one token per row from exactly softmax(logits / T): (n, V) -> (n,)
    # By inverse CDF: one uniform number per row, where torch.multinomial draws one per vocabulary entry
    cdf = (logits.float() / temperature).softmax(-1).double().cumsum(-1)                  # (n, V)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]       # (n, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.size(1) - 1)

@torch.no_grad()
def generate_completions(model, tokenizer, prompt_ids, prompt_mask, args, eos_token_ids=None):
    """G completions per prompt, token by token with the KV cache, from softmax(logits / T) alone (no top-k or
    top-p: section 4's log-probs describe exactly what sampled), each ending at its first EOS (any of
    eos_token_ids; None: the tokenizer's). Returns prompts ×G (B·G, P), completions (B·G, C) and masks."""
    G, C, eos = args.num_generations, args.max_completion_length, tokenizer.eos_token_id
    eos = torch.as_tensor(eos if eos_token_ids is None else eos_token_ids, device=prompt_ids.device)
    positions = position_ids(prompt_mask)                                                 # (B, P)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    out.cache.batch_repeat_interleave(G)  # each prompt runs once; its G completions share its KV cache
    logits = out.logits[:, -1].repeat_interleave(G, 0)                                    # (n = B·G, V)
    mask, position = prompt_mask.repeat_interleave(G, 0), positions[:, -1:].repeat_interleave(G, 0)
    done, tokens = torch.zeros(len(mask), dtype=torch.bool, device=mask.device), []       # (B·G,)
    for t in range(C):
        token = sample_token(logits, args.temperature).masked_fill(done, tokenizer.pad_token_id)  # (B·G,)
        tokens.append(token)
        done = done | torch.isin(token, eos)
        if t % DONE_CHECK[token.device.type] == 0 and done.all():  # a GPU syncs with the host to know
            break
        mask, position = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), position + 1  # (B·G, P+t+1)
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                       cache=out.cache, use_cache=True).logits[:, -1]                     # (B·G, V)
    completion_ids = torch.stack(tokens, 1)                                               # (B·G, C)
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion_ids,
            completion_mask(completion_ids, eos))

# ---- 3. Rewards and group-normalized advantages ------------------------------------------------------
def score_completions(reward_funcs, prompts, completions, completion_ids, columns):
    """r_i per reward function, each called TRL-style on its own copy of f(prompts=, completions=,
    completion_ids=, **columns): one number per completion, or None ("does not apply"). (N, F), NaN = None."""
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    rewards_per_func = torch.stack([call_reward(f, copy.deepcopy(kwargs)) for f in reward_funcs], 1)  # (N, F)
    i = next(iter(rewards_per_func.isnan().all(1).nonzero()[:, 0].tolist()), None)  # scored by none of them?
    require(i is None, f"every reward function returned None for completion {i} ("
            f"{completions[i or 0]!r:.80}); at least one must score each completion")
    return rewards_per_func

def group_advantages(rewards, num_generations, scale_rewards="group"):
    """A_i = (r_i - mean_group(r)) / (std_group(r) + 1e-4), std unbiased (G - 1) as in TRL; scale_rewards=
    'none' (Dr. GRPO) drops the division. A prompt's completions are adjacent: rows [k·G, (k+1)·G)."""
    grouped = rewards.view(-1, num_generations)                               # (B, G)
    scale = grouped.std(1, keepdim=True) + 1e-4 if scale_rewards == "group" else 1.0  # 'none': no division
    advantages = (grouped - grouped.mean(1, keepdim=True)) / scale            # (B, G)
    # A group of equal rewards carries no signal: exactly 0 (a float mean of equal numbers can miss them).
    all_equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return advantages.masked_fill(all_equal, 0.0).view(-1)                    # (B·G,)

# ---- 4. Per-token log-probs: log π(o_t | q, o_<t) of the completion tokens ----------------------------
def plain_per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """log π(o_t | q, o_<t) by its definition: one forward pass over prompt and completion; the state at t
    predicts token t+1: log_softmax(lm_head(h) / T) before each completion token, gathered at it (T: the
    sampling temperature, so π_old is what sampled). The trainer calls per_token_logps: the same, faster."""
    mask = torch.cat([prompt_mask, completion_mask], 1)                                   # (b, P+C)
    hidden = model.get_decoder()(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                                 position_ids=position_ids(mask)).last_hidden_state      # (b, P+C, H)
    logits = model.get_output_embeddings()(hidden[:, prompt_ids.size(1) - 1:-1]).float()  # (b, C, V)
    return (logits / temperature).log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)  # (b, C)

def rows(batch, start, stop):  # rows [start, stop) of every per-completion tensor; the 0-dim ones whole
    return {k: v[start:stop] if v.dim() else v for k, v in batch.items()}

def mini_batches(batch, S):
    """A generation batch cut into its S mini-batches: one optimizer step's completions each."""
    n = len(batch["completion_mask"]) // S
    return [rows(batch, j * n, (j + 1) * n) for j in range(S)]

def micro_batches(batch, size):
    """A mini-batch cut into micro-batches of `size` completions, one forward and backward each (gradient
    accumulation), each cut to its longest prompt and completion: padding costs compute, changes nothing."""
    for i in range(0, len(batch["completion_mask"]), size):
        mb = rows(batch, i, i + size)
        c, p = max(1, int(mb["completion_mask"].sum(1).max())), int(mb["prompt_mask"].sum(1).max())
        for k, v in mb.items():
            if v.dim() == 2:  # prompts are left-padded: keep their last p columns; completions their first c
                mb[k] = v[:, v.size(1) - p:] if k.startswith("prompt") else v[:, :c]
        yield mb

@torch.no_grad()
def cached_logps(trainer, model, batch):
    """π_old's or π_ref's log-probs, in the training passes' micro-batches: step 1's ratio is exactly 1."""
    with autocast(trainer):
        logps = [per_token_logps(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                                 mb["completion_mask"], trainer.args.temperature)[0]           # (b, c) each
                 for mb in micro_batches(batch, trainer.args.per_device_train_batch_size)]
    # Each micro-batch was cut to its longest completion: zeros pad it back to the batch's width (masked).
    return torch.cat([F.pad(x, (0, batch["completion_ids"].size(1) - x.size(1))) for x in logps])  # (N, C)

# ---- 5. The clipped objective, for one micro-batch ---------------------------------------------------
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, args, num_seqs, num_tokens):
    """The GRPO objective, negated. logps, old_logps, ref_logps, mask: (b, C); advantages: (b,). num_seqs
    and num_tokens count one optimizer step (all its micro-batches, all ranks; with S > 1 num_tokens is the
    generation batch's mean per step), so the micro-batches' losses sum to the step's loss."""
    A = advantages[:, None]                                                # (b, 1): one A per sequence
    eps_high = args.epsilon if args.epsilon_high is None else args.epsilon_high  # None: ε, as in TRL
    log_ratio = logps - old_logps                                          # log ρ_t, ρ_t = π_θ / π_old
    if args.importance_sampling_level == "sequence":  # GSPO: one ρ per completion, exp(mean_t log ρ_t)
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (b, 1)
    coef_1 = torch.exp(log_ratio)                                          # ratio ρ
    coef_2 = torch.clamp(coef_1, 1 - args.epsilon, 1 + eps_high)           # clip(ρ, 1 - ε, 1 + ε_high)
    per_token_loss = -torch.min(coef_1 * A, coef_2 * A)                    # -min(ρA, clip(ρ)A)
    # Where ρ has left [1 - ε, 1 + ε_high] in the direction A pushes it, min() picks the constant
    # clip(ρ)A: that token's policy term stops pushing, which keeps μ steps on one batch near π_old (a soft
    # trust region: the KL term and the other tokens, through shared weights, still move it).
    if args.beta > 0:                                                      # + β · KL_k3(π_θ ‖ π_ref)
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # k3 estimator, >= 0
        if args.use_bias_correction_kl:                                    # KL's estimate under π_θ
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + args.beta * per_token_kl
    if args.loss_type == "grpo":    # paper: mean over each sequence's tokens, then over sequences
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    elif args.loss_type == "bnpo":  # TRL PR #2899's: each micro-batch's token mean × its share of the step
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) * len(mask) / num_seqs
    elif args.loss_type == "dapo":  # DAPO: ÷ the step's tokens (S > 1: the mean per step, as in TRL)
        loss = (per_token_loss * mask).sum() / num_tokens
    else:                           # Dr. GRPO: constant normalizer, no length bias at all
        loss = (per_token_loss * mask).sum() / (num_seqs * args.max_completion_length)
    with torch.no_grad():  # metrics: clipped tokens (only where the clip removes the gradient), KL
        stats = {"clip_low": ((coef_1 < 1 - args.epsilon) & (A < 0) & (mask > 0)).sum(),
                 "clip_high": ((coef_1 > 1 + eps_high) & (A > 0) & (mask > 0)).sum()}
        if args.beta > 0:
            stats["kl"] = (per_token_kl * mask).sum()
    return loss, stats

# ---- 6. The μ-iteration loop: generate -> score -> cache -> μ optimizer steps -------------------------
class GRPOTrainer:
    """GRPOTrainer(model, reward_funcs, args, train_dataset).train(), as in TRL. model: a hub id, a folder or
    a causal LM. reward_funcs: f(prompts, completions, **kwargs) -> a number (or None) per completion, or a
    list of them. train_dataset: a Dataset with a "prompt" column; the others reach the reward functions."""

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, processing_class=None,
                 peft_config=None):  # a peft.LoraConfig, or a peft.PeftModel as model: the adapter trains
        self.args = args = args if args is not None else GRPOConfig()
        self.rank, self.world_size, self.device = init_distributed()           # torchrun, or one process
        self.reward_funcs, self.dataset = check_inputs(args, reward_funcs), check_dataset(train_dataset)
        self.model, self.tokenizer = load_policy(model, processing_class, peft_config, args, self.device)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)  # the tokenizer's and the model's
        self.ref_model = None if args.beta == 0 else reference_model(self.model)  # π_ref: frozen (Part II)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                           lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
        new_run(self)  # step 0, the schedule, counters, should_stop (a subclass's log() may set it) (Part II)

    def train(self, resume_from_checkpoint=None):
        """Algorithm 1: a generation batch of S mini-batches, then μ passes over them, an optimizer step per
        mini-batch: μ·S steps per generation. TRL's two readings of "multi-step": μ > 1 (TRL PR #2899)
        reuses each mini-batch; S > 1 (steps_per_generation) uses each once, later ones stale by updates."""
        # start_run checks the inputs, locks output_dir, resumes or seeds; from then on a failure checkpoints.
        with checkpoint_on_failure(self, resume_from_checkpoint):
            args, S = self.args, mini_batches_per_generation(self.args)
            cycle = args.num_iterations * S  # optimizer steps per generation batch
            # A resume inside a generation batch has its batch back from the checkpoint.
            minibatches = None if self.batch is None else mini_batches(self.batch, S)
            while self.step < args.max_steps and not self.should_stop:
                metrics = {}
                if self.step % cycle == 0:  # a new generation batch: generate, score, cache, cut in S
                    self.batch, metrics = self.generate_and_score(self.step // cycle)
                    minibatches = mini_batches(self.batch, S)
                j = self.step % cycle  # this step's place in the cycle: pass j // S (of μ), mini-batch j % S
                metrics.update(self.optimizer_step(minibatches[j % S]))
                self.step += 1  # the last finished step, the one that a failure from here on checkpoints
                end_of_step(self, metrics)               # log, checkpoint, stop on trouble (Part II)
            save_checkpoint(self, final=True)            # and the trained model, into output_dir (Part II)
        return self

    def generate_and_score(self, k):
        """Sections 2-4 for generation batch k: generate, score, cache what its μ·S optimizer steps need."""
        args, G, S = self.args, self.args.num_generations, mini_batches_per_generation(self.args)
        rows = self.dataset.select(prompt_rows(self, k)).to_dict()                  # {column: [values]}
        prompts = rows.pop("prompt")
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompts, args.max_prompt_length)
        lap(self, "generate")
        with autocast(self):
            prompt_ids, prompt_mask, completion_ids, mask = generate_completions(self.model, self.tokenizer,
                prompt_ids.to(self.device), prompt_mask.to(self.device), args, self.eos_token_ids)
        lap(self, None)
        # 3. The reward functions see text: each prompt, repeated G times, beside its completions.
        ids = [row[:n] for row, n in zip(completion_ids.tolist(), mask.sum(1).tolist())]  # to the first EOS
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        chat = not isinstance(prompts[0], str)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
        repeat = lambda xs: [x for x in xs for _ in range(G)]
        rewards_per_func = on_every_rank(self, score_completions, self.reward_funcs, repeat(prompts),
                                         completions, ids, {c: repeat(v) for c, v in rows.items()})  # (N, F)
        weights = torch.tensor(args.reward_weights or [1.0] * len(self.reward_funcs))        # (F,)
        rewards = (rewards_per_func * weights).nansum(1)                     # (N,): r_i = Σ_f w_f r_if
        advantages = group_advantages(rewards, G, args.scale_rewards).to(self.device)      # (N,)
        truncated = ~torch.isin(completion_ids, self.eos_token_ids).any(1)  # (N,): no EOS, cut at C tokens
        loss_mask = mask * ~truncated[:, None] if args.mask_truncated_completions else mask   # (N, C)
        # The loss's normalizers count one optimizer step: its completions (num_seqs) and their tokens
        # (num_tokens), over every micro-batch and every rank. A generation batch holds S steps' worth, so
        # each is its total over the ranks divided by S; num_tokens is thus the mean per step (TRL's dapo).
        num_seqs = all_reduce(self, torch.tensor(float(len(mask)), device=self.device)) / S
        num_tokens = all_reduce(self, loss_mask.sum().float()) / S
        batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                 "completion_mask": loss_mask, "advantages": advantages,
                 "num_seqs": num_seqs, "num_tokens": num_tokens}
        # 4. Cached log-probs, once per generation batch: π_old only where a step is not the batch's first
        # (with μ·S = 1 the training pass's own log-probs, detached, are π_old's), π_ref only when β > 0.
        lap(self, "logps")
        if args.num_iterations * S > 1:
            batch["old_logps"] = cached_logps(self, self.model, batch)     # (N, C)
        if args.beta > 0:  # a PeftModel is its own π_ref, its adapter disabled: no copy of the weights
            with self.ref_model.disable_adapter() if is_peft(self.ref_model) else nullcontext():
                batch["ref_logps"] = cached_logps(self, self.ref_model, batch)  # (N, C)
        lap(self, None)
        self.samples = list(zip(repeat(prompts), texts, rewards.tolist()))
        return batch, batch_metrics(self, rewards_per_func, rewards, mask, truncated.float())

    def optimizer_step(self, batch):
        """An optimizer step on a generation batch's mini-batch: forward, clipped loss, backward, AdamW."""
        args, sums = self.args, defaultdict(float)
        for mb in micro_batches(batch, args.per_device_train_batch_size):         # gradient accumulation
            lap(self, "forward")
            with autocast(self):
                logps, entropy = per_token_logps(self.model, mb["prompt_ids"], mb["prompt_mask"],
                    mb["completion_ids"], mb["completion_mask"], args.temperature)           # (b, C) each
            old_logps = mb["old_logps"] if "old_logps" in mb else logps.detach()  # π_old
            loss, stats = grpo_loss(logps, old_logps, mb.get("ref_logps"), mb["advantages"],
                                    mb["completion_mask"], args, batch["num_seqs"], batch["num_tokens"])
            stats["entropy"] = (entropy * mb["completion_mask"]).sum()  # H(π_θ) over the loss's tokens
            lap(self, "backward")
            loss.backward()
            for k, v in {"loss": loss.detach(), "tokens": mb["completion_mask"].sum(), **stats}.items():
                sums[k] = sums[k] + v                  # tensors: no GPU sync per micro-batch
        all_reduce_gradients(self)                    # torchrun: the sum of every rank's gradient
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm or math.inf)
        metrics = step_metrics(self, sums, grad_norm)  # with the lr it applies
        lap(self, "optimizer")                        # (Part II: from here a signal waits for the step's end)
        if torch.isfinite(grad_norm):                 # else skip: weights and optimizer state untouched
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def log(self, metrics):  # override to hook in
        write_metrics(self, metrics)  # rank 0 prints a line and appends it to output_dir/metrics.jsonl

# ======================================= PART II: THE ENGINEERING =======================================
# plain_per_token_logps, fast (tested equal): prompt sharing, a chunked LM head (no (b, C, V) logits at once);
# with each token's entropy H(π(· | q, o_<t)) beside its log-prob, from the same logits: (b, C) each
def per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    mask = torch.cat([prompt_mask, completion_mask], 1)                                   # (b, P+C)
    decoder, P, positions = model.get_decoder(), prompt_ids.size(1), position_ids(mask)     # (b, P+C)
    if model.is_activation_checkpointing:  # one pass: recomputed layers cannot share a prompt's KV cache
        hidden = decoder(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                         position_ids=positions).last_hidden_state[:, P - 1:-1]           # (b, C, H)
    else:  # prompt sharing: B·P + B·G·C tokens, not B·G·(P + C): G completions attend to one prompt pass
        first = torch.ones(len(prompt_ids), dtype=torch.bool, device=mask.device)  # (b,): a prompt's 1st row
        first[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1)
        prompt_of = first.cumsum(0) - 1                                            # (b,): each row's prompt
        prompt = decoder(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                         position_ids=positions[first, :P], use_cache=True)
        prompt.cache.batch_select_indices(prompt_of)                      # (b, heads, P, d) keys, values
        completion = decoder(input_ids=completion_ids, attention_mask=mask, position_ids=positions[:, P:],
                             cache=prompt.cache, use_cache=True).last_hidden_state         # (b, C, H)
        # The prompt's last state predicts completion token 0; completion token t's state predicts t+1.
        hidden = torch.cat([prompt.last_hidden_state[prompt_of, -1:], completion[:, :-1]], 1)  # (b, C, H)
    head = model.get_output_embeddings()  # logits = lm_head(hidden), as load_policy checks
    pairs = zip(hidden.flatten(0, 1).split(CHUNK), completion_ids.flatten().split(CHUNK))  # (n, H), (n,)
    logps, entropies = zip(*[TokenLogps.apply(h, y, temperature, head.weight, head.bias) for h, y in pairs])
    return torch.cat(logps).view_as(completion_ids), torch.cat(entropies).view_as(completion_ids)

# The LM head, CHUNK tokens at a time: log π(y) = z_y - logsumexp(z), z = (h Wᵀ + b) / T; forward keeps h,
# logsumexp(z); backward redoes z in place into onehot(y) - softmax(z): vs checkpointing, -0.27 GiB, -5 % time
CHUNK = 256  # 256 × 49152 logits: 50 MB for SmolLM2
DONE_CHECK = defaultdict(lambda: 8, cpu=1)  # decode steps between "all ended?" checks: GPU syncs; CPU: free

class TokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, temperature, weight, bias):            # hidden (n, H), targets (n,)
        logits = F.linear(hidden, weight, bias).float().div_(temperature)                 # (n, V): z
        lse = logits.logsumexp(-1)                                                          # (n,)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.temperature, ctx.bf16 = temperature, torch.is_autocast_enabled(hidden.device.type)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse                        # (n,)
        log_probs = logits.sub_(lse[:, None])                          # (n, V): log π(v), in z's memory
        entropy = -log_probs.exp().mul_(log_probs).sum(-1)  # (n,): -Σ_v π(v) log π(v), for the metric only
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _):                               # grad (n,): d loss / d log π(y)
        hidden, targets, weight, bias, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, torch.bfloat16, enabled=ctx.bf16):  # as in forward
            logits = F.linear(hidden, weight, bias).float()                                 # (n, V)
        grad_z = logits.div_(ctx.temperature).sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax·grad
        grad_z.scatter_add_(1, targets[:, None], grad[:, None])                # + onehot(y)·grad
        grad_logits = grad_z.div_(ctx.temperature).to(weight.dtype)            # dz/dlogits = 1/T
        grad_weight = grad_logits.T @ hidden.to(weight.dtype) if ctx.needs_input_grad[3] else None
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[4] else None
        return (grad_logits @ weight).to(hidden.dtype), None, None, grad_weight, grad_bias

def prompt_rows(trainer, k):  # of generation batch k: a function of k alone, so a resume picks the same ones
    args, n, S = trainer.args, len(trainer.dataset), mini_batches_per_generation(trainer.args)
    p = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations  # prompts
    # This rank's share of each of the batch's S optimizer steps: any number of ranks make the same steps.
    firsts = [((k * S + j) * trainer.world_size + trainer.rank) * p for j in range(S)]
    return [epoch_order(n, args.seed + i // n)[i % n] for first in firsts for i in range(first, first + p)]

@functools.lru_cache(maxsize=2)
def epoch_order(n, seed):  # one seeded permutation of the rows per epoch, the same on every rank
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

PHASES = ("generate", "logps", "forward", "backward", "optimizer")  # timed (on a GPU, synchronized at each)

def lap(trainer, phase):  # end the running phase, start `phase` (None: between phases, not reported)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    now = time.perf_counter()
    trainer.seconds[trainer.phase] += now - trainer.phase_start
    trainer.phase, trainer.phase_start = phase, now

def autocast(trainer):  # bf16: every model call under bfloat16 autocast; the loss and AdamW stay float32
    return torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=trainer.args.bf16)

# torchrun: each rank runs this program on its own prompts, its loss divided by the whole step's normalizers:
def init_distributed():  # the ranks' gradients sum to the step's (DDP's job; its hooks miss our LM head call)
    local_rank, cuda = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        require(not cuda or local_rank < torch.cuda.device_count(), f"LOCAL_RANK={local_rank} but "
                f"{torch.cuda.device_count()} GPUs are visible: run torchrun with --nproc_per_node <= that")
        if cuda:
            torch.cuda.set_device(local_rank)  # before any collective: NCCL uses the current device
        dist.init_process_group("nccl" if cuda else "gloo")
        atexit.register(end_distributed)  # else NCCL's threads may abort the exit, after the work is saved
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return rank, world_size, torch.device(f"cuda:{local_rank}" if cuda else "cpu")

def end_distributed():  # the process group that init_distributed made, unless the script ended it already
    if dist.is_initialized():
        dist.destroy_process_group()

def all_reduce(trainer, x):  # sum over ranks, in place (dist.all_reduce returns None; one process: x as is)
    return dist.all_reduce(x) or x if trainer.world_size > 1 else x

def all_reduce_gradients(trainer):  # one flat buffer, one call
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if trainer.world_size > 1 and grads:
        flat = all_reduce(trainer, torch.cat([g.flatten() for g in grads]))
        torch.nn.utils.vector_to_parameters(flat, grads)  # each gradient, now a view of the summed buffer

def on_every_rank(trainer, fn, *args):  # user code (reward functions): an error on one rank is raised on
    try:                                # all, so that none is left waiting for the others in a collective
        result, error = fn(*args), None
    except Exception as e:
        result, error = None, e
    if all_reduce(trainer, torch.tensor(float(error is not None), device=trainer.device)) > 0:
        raise error or RuntimeError("a reward function failed on another rank (see its log)")
    return result

def batch_metrics(trainer, rewards_per_func, rewards, mask, truncated):  # means over ranks (one all-reduce)
    grouped = rewards.view(-1, trainer.args.num_generations)                                # (B, G)
    flat = (grouped.max(1).values == grouped.min(1).values).float()  # (B,): groups with no signal (section 3)
    m = {"reward": rewards.mean(), "reward_std": grouped.std(1).mean(), "frac_reward_zero_std": flat.mean(),
         "completion_length": mask.sum(1).float().mean(), "completions/clipped_ratio": truncated.mean()}
    names = [getattr(f, "__name__", type(f).__name__) for f in trainer.reward_funcs]
    for i, name in enumerate(names):  # one metric per function, numbered where names repeat (two lambdas)
        number = f"_{names[:i].count(name) + 1}" if names.count(name) > 1 else ""
        m[f"rewards/{name}{number}"] = rewards_per_func[:, i].nanmean()
    means = all_reduce(trainer, torch.stack([v.float().to(trainer.device) for v in m.values()]))
    return dict(zip(m, (means / trainer.world_size).tolist()))

def step_metrics(trainer, sums, grad_norm):  # sums over micro-batches and ranks
    s = dict(zip(sums, all_reduce(trainer, torch.stack([v.float() for v in sums.values()])).tolist()))
    n, finite = max(s["tokens"], 1.0), bool(grad_norm.isfinite())  # (0: every completion masked)
    trainer.nonfinite_in_a_row = 0 if finite else trainer.nonfinite_in_a_row + 1
    if not finite:
        warnings.warn(f"step {trainer.step + 1}: non-finite loss or gradient norm ({float(grad_norm)}); step "
                      f"skipped ({trainer.nonfinite_in_a_row} in a row)", stacklevel=3)
    return {"loss": s["loss"], "grad_norm": float(grad_norm), **({"kl": s["kl"] / n} if "kl" in s else {}),
            "learning_rate": trainer.scheduler.get_last_lr()[0], "clip_ratio_low": s["clip_low"] / n,
            "clip_ratio_high": s["clip_high"] / n, "entropy": s["entropy"] / n,
            "nonfinite_steps": float(not finite)}

def end_of_step(trainer, metrics):  # log every logging_steps, checkpoint every save_steps, stop on trouble
    trainer.snapshot = gather_snapshot(trainer)  # first: what a checkpoint of this step holds (a collective)
    lap(trainer, None)  # the update is over: from here on a signal stops the run at once
    metrics.update({f"time_{k}": trainer.seconds.pop(k, 0.0) for k in PHASES})
    require(trainer.nonfinite_in_a_row < 3, f"training stopped at step {trainer.step}: 3 optimizer steps "
            "in a row had a non-finite loss or gradient norm (check the rewards, the lr, bf16)", RuntimeError)
    if "frac_reward_zero_std" in metrics:  # no signal left to learn from: all rewards of each group alike
        trainer.flat_in_a_row = trainer.flat_in_a_row + 1 if metrics["frac_reward_zero_std"] == 1 else 0
        if trainer.flat_in_a_row == 3:
            warnings.warn(f"step {trainer.step}: every group's rewards were equal for 3 generation batches "
                          "in a row (gradient 0): a reward that does not vary, or completions all alike (a "
                          "temperature too low, a policy collapsed by a high learning rate)", stacklevel=3)
    for k, v in metrics.items():
        trainer.window[k].append(v)
    if trainer.step % trainer.args.logging_steps == 0 or trainer.step == trainer.args.max_steps:
        trainer.saving += 1  # a signal waits for log() (a tracker's upload): a step saved is a step logged
        row = {"step": trainer.step, **{k: sum(v) / len(v) for k, v in trainer.window.items()},
               "elapsed": trainer.snapshot[trainer.rank]["elapsed"]}
        trainer.window.clear()  # handed to log(): a checkpoint from here on holds the steps after this row
        trainer.log(row)
        trainer.saving -= 1  # (if log() fails, train() ends: no need to undo it)
    if trainer.signal:  # it came during the update or log(), which ended first
        raise stop_for(trainer.signal)
    if trainer.step % trainer.args.save_steps == 0 and trainer.step < trainer.args.max_steps:
        save_checkpoint(trainer)
    stop = all_reduce(trainer, torch.tensor(float(trainer.should_stop), device=trainer.device))
    trainer.should_stop = bool(stop > 0)  # log() may ask to stop (a target reached): every rank stops here

def strict_json(m):  # what jq and JSON.parse read: null for a float that is not finite (NaN, inf)
    return json.dumps({k: v if type(v) is not float or math.isfinite(v) else None for k, v in m.items()})

def write_metrics(trainer, metrics):
    if trainer.rank == 0:
        with open(os.path.join(trainer.args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(strict_json(metrics) + "\n")
        print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
        for prompt, completion, reward in trainer.samples[:4] if trainer.args.log_completions else []:
            prompt = prompt if isinstance(prompt, str) else prompt[-1]["content"]  # a chat's last turn
            print(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")

# Checkpoints: atomic, run no code, resume bit-identically; rank 0 saves every rank's last finished step
def stop_for(signum):  # Ctrl-C: KeyboardInterrupt; SIGTERM (preemption), SIGHUP (ssh lost), ...: 128 + signum
    return KeyboardInterrupt() if signum == signal.SIGINT else SystemExit(128 + signum)

def start_run(trainer, resume_from_checkpoint):  # check again; resume, or start where no run's work is lost
    args, out, path = trainer.args, trainer.args.output_dir, resume_from_checkpoint
    check_config(args)  # fields may have changed since the trainer was made
    check_inputs(args, trainer.reward_funcs)
    check_trainable(trainer.model)  # float32 still (trainer.model.to(...) since?): refused before AdamW fails
    require(args.beta == 0 or trainer.ref_model is not None, "beta was 0 at construction: no reference model")
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    require(trained == {id(p) for p in trainer.model.parameters() if p.requires_grad}, "trainer.model's "
            "trainable weights are not its optimizer's (a model replaced, or frozen since): make a new one")
    require(not (os.path.isdir(mine := trainer.model.config._name_or_path) and os.path.samefile(mine, out)),
            f"output_dir {out!r} is the model's own folder, which the run would overwrite: choose another")
    P, C, config = args.max_prompt_length, args.max_completion_length, trainer.model.config
    n = None if getattr(config, "rope_parameters", None) else getattr(config, "max_position_embeddings", None)
    require(not n or (P or n) + C <= n, f"max_prompt_length={P} + max_completion_length={C} exceed "
            f"the model's table of {n} positions (as GPT-2's: past it, an IndexError): keep the sum <= {n}")
    trainer.model.activation_checkpointing_disable()  # as the config says now: set or unset since loading
    if args.gradient_checkpointing:
        trainer.model.activation_checkpointing_enable({"use_reentrant": False})
    if trainer.rank == 0 and os.name == "posix":  # one run per output_dir: rank 0 flocks it till train() ends
        trainer.on_exit.callback(os.close, fd := os.open(out, os.O_RDONLY))  # (a killed process's lock goes
        with suppress(BlockingIOError):                                       # with it; Windows: no fcntl)
            fd = (fcntl := importlib.import_module("fcntl")).flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # None
        require(fd is None, f"output_dir {out!r} is locked: another process is training there")
    real = os.path.realpath(out)  # own: a resume from inside output_dir (True: its newest checkpoint)
    own = path is True or bool(path) and os.path.commonpath([os.path.realpath(path), real]) == real
    ours = sorted(n for n in os.listdir(out) if re.fullmatch(r"metrics\.jsonl|checkpoint-\d+(\.tmp)?", n))
    earlier = [os.path.join(out, n) for n in ours] + final_model_files(out)  # all that a run there wrote
    require(own or not earlier or args.overwrite_output_dir, f"output_dir {out!r} holds another run ("
            f"{', '.join(map(os.path.basename, earlier))}): resume it with train(resume_from_checkpoint="
            "True), choose another output_dir, or set overwrite_output_dir=True (deletes it, starts afresh)")
    # The final save writes the model's and tokenizer's files into output_dir: never over a user's own.
    theirs = sorted(final_save_names(trainer) & set(os.listdir(out)) - set(map(os.path.basename, earlier)))
    require(not theirs or args.overwrite_output_dir, f"output_dir {out!r} holds {', '.join(theirs)}, which "
            "no run here wrote and the final save would overwrite: choose another output_dir, or set "
            "overwrite_output_dir=True (the final save then overwrites them)")
    if earlier and not own and trainer.rank == 0:  # what that run wrote, and nothing else
        warnings.warn("overwrite_output_dir deletes " + ", ".join(map(os.path.basename, earlier)))
        for p in earlier:
            remove(p)
    new_run(trainer)
    if path:
        load_checkpoint(trainer, path)
    trainer.saved_step = trainer.step if own else None  # a checkpoint is written once, never replaced
    trainer.snapshot = gather_snapshot(trainer)

def new_run(trainer):  # step 0, seeded; no counter, clock or gradient of an earlier train() (weights stay)
    trainer.step, trainer.batch, trainer.samples = 0, None, []  # batch: a μ cycle's cached generation batch
    for seed in (random.seed, numpy.random.seed, torch.manual_seed):  # transformers' set_seed imports peft
        seed(trainer.args.seed + trainer.rank)  # the same prompts on every rank (prompt_rows), other samples
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.scheduler, trainer.nonfinite_in_a_row, trainer.flat_in_a_row = lr_schedule(trainer), 0, 0
    trainer.phase, trainer.seconds, trainer.window = None, defaultdict(float), defaultdict(list)
    trainer.signal, trainer.saving, trainer.should_stop = None, 0, False
    trainer.start_time = trainer.phase_start = time.perf_counter()

def lr_schedule(trainer, step=0):  # AdamW's learning rate from `step` on: linear decay to 0, or constant
    args = trainer.args
    for group in trainer.optimizer.param_groups:  # the config's values, also on a resume that changed them
        group.update(initial_lr=args.learning_rate, weight_decay=args.weight_decay)
    decay = (lambda s: 1 - s / args.max_steps) if args.lr_scheduler_type == "linear" else (lambda s: 1.0)
    return torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, decay, last_epoch=step - 1)

def gather_snapshot(trainer):  # each rank's RNG states, samples, elapsed and, inside a μ cycle, batch (CPU)
    inside_a_cycle = trainer.step % (trainer.args.num_iterations * mini_batches_per_generation(trainer.args))
    batch = {k: v.cpu() for k, v in trainer.batch.items()} if inside_a_cycle else None
    rng = dict(python=random.getstate(), torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all(),
               numpy=[(n := numpy.random.get_state())[0], n[1].tolist(), *n[2:]])  # a list: weights_only
    this_rank = {"step": trainer.step, "rng": rng, "samples": trainer.samples, "batch": batch,
                 "elapsed": time.perf_counter() - trainer.start_time}
    ranks = [this_rank] * trainer.world_size  # on rank 0, every rank's; elsewhere its own
    if trainer.world_size > 1:  # at the end of the update, a moment every rank reaches together
        dist.gather_object(this_rank, ranks if trainer.rank == 0 else None, dst=0)
    return ranks

@contextmanager
def checkpoint_on_failure(trainer, resume_from_checkpoint):  # start_run, then guard the run
    def on_signal(signum, frame):  # stop at once, unless the weights or files are being written, or an
        trainer.signal = trainer.signal or signum  # error is being handled: then where that ends
        if trainer.phase != "optimizer" and not trainer.saving and sys.exc_info()[1] is None:
            raise stop_for(signum)
    with ExitStack() as trainer.on_exit:  # at the end, even of a failed start: handlers back, lock freed
        start_run(trainer, resume_from_checkpoint)
        main = threading.current_thread() is threading.main_thread()  # only it can set signal handlers
        names = "SIGINT SIGTERM SIGHUP SIGUSR1 SIGQUIT".split() if main else []  # USR1: SLURM's --signal
        for s in [getattr(signal, name) for name in names if hasattr(signal, name)]:  # restored at the end
            trainer.on_exit.callback(signal.signal, s, signal.signal(s, on_signal))
        try:
            yield
        except BaseException as e:
            trainer.saving += 1  # first: from here on a signal waits for the checkpoint of the finished steps
            if trainer.step > 0 and trainer.phase != "optimizer":  # an update begun: no step to save whole
                save_checkpoint(trainer)
            elif trainer.step > 0 and trainer.rank == 0:
                warnings.warn("an error in a weight update: its step is not checkpointed (earlier ones stay)")
            if trainer.signal and not isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise stop_for(trainer.signal) from e  # a collective that failed as another rank stopped
            raise

def save_checkpoint(trainer, final=False):  # rank 0, from the last finished step's snapshot: no collective
    args, step, out = trainer.args, trainer.step, trainer.args.output_dir
    folder = os.path.join(out, f"checkpoint-{step}")
    trainer.saving += 1  # a signal that comes while files are written waits for them to be complete
    try:
        if trainer.rank == 0 and trainer.saved_step != step:  # (else written already, or resumed from)
            shutil.rmtree(folder + ".tmp", ignore_errors=True)
            native = {} if is_peft(trainer.model) else {"save_original_format": False}  # the names it loads
            trainer.model.save_pretrained(folder + ".tmp", **native)
            torch.save({"step": step, "optimizer": trainer.optimizer.state_dict(), "ranks": trainer.snapshot,
                        "config": {**asdict(args), "train_dataset": trainer.dataset._fingerprint,
                                   "adapter": adapter_config(trainer.model)},
                        "window": dict(trainer.window), "moments": len(trainer.optimizer.state),
                        "lr_step": trainer.scheduler.last_epoch, "world_size": trainer.world_size,
                        "nonfinite_in_a_row": trainer.nonfinite_in_a_row}, f"{folder}.tmp/trainer_state.pt")
            os.replace(folder + ".tmp", folder)  # atomic: a checkpoint folder is complete or absent
            for old in list_checkpoints(out)[:-(args.save_total_limit or 0)]:  # None: keep all
                remove(old)
            trainer.saved_step = step
        if final and trainer.rank == 0:  # the model, for from_pretrained(output_dir), then a list of it
            before = set(os.listdir(out)) - set(map(os.path.basename, final_model_files(out)))  # (earlier's)
            trainer.model.save_pretrained(out)
            trainer.tokenizer.save_pretrained(out)  # overwrite and roll back touch the listed files, no other
            names = sorted(set(os.listdir(out)) - before - {"final_model_files.json"})
            pathlib.Path(out, "final_model_files.json").write_text(json.dumps(names))
    except Exception as e:  # a full disk? torch's message names neither that nor the path
        shutil.rmtree(folder + ".tmp", ignore_errors=True)  # the unfinished folder: it frees its space
        free = shutil.disk_usage(out).free >> 20
        raise OSError(f"could not write {out!r} ({free} MiB free): {e!r}") from None
    finally:
        trainer.saving -= 1
    if trainer.signal and not trainer.saving:
        raise stop_for(trainer.signal)

def load_checkpoint(trainer, path):
    shape = ("num_iterations steps_per_generation num_generations per_device_train_batch_size "
             "gradient_accumulation_steps world_size").split()  # what its batch, prompts and RNG depend on
    cached = ("temperature", "beta", "scale_rewards", "reward_weights")  # what its cached batch was made with
    args, found = trainer.args, list_checkpoints(trainer.args.output_dir) if path is True else [path]
    require(found, f"resume_from_checkpoint=True but {args.output_dir!r} holds no checkpoint (a run stopped "
            "before its first save leaves none): start afresh (overwrite_output_dir=True if one is there)")
    path, file = found[-1], os.path.join(found[-1], "trainer_state.pt")
    require(os.path.isfile(file), f"resume_from_checkpoint={path!r} is not a checkpoint: "
            + ("no trainer_state.pt in it" if os.path.isdir(path) else "not a checkpoint-<step> folder"))
    peft = is_peft(trainer.model)
    names = ("adapter_model.safetensors", "model.safetensors")
    wanted, other = (os.path.join(path, n) for n in (names if peft else names[::-1]))
    theirs, ours = ("the whole model", "an adapter") if peft else ("a LoRA adapter", "the whole model")
    require(os.path.exists(wanted) or not os.path.exists(other), f"checkpoint {path!r} holds "
            f"{os.path.basename(other)}: a run that trained {theirs} wrote it; this one trains {ours}")
    try:  # tensors and plain Python values only (no pickled pytorch_model.bin), no config: no code runs
        state = torch.load(file, map_location=trainer.device, weights_only=True)
        file = wanted
        weights = safetensors.torch.load_file(file, device=str(trainer.device))  # the file's own tensors
    except Exception as e:
        raise ValueError(f"{file} holds objects other than tensors and plain values (it could run code)"
                         if "Weights only load failed" in str(e) else f"{file} is missing" if not
                         os.path.exists(file) else f"{file} is corrupted ({e})") from None
    get, load = (type(trainer.model).state_dict, type(trainer.model).load_state_dict) if not peft else (
        sys.modules["peft"].get_peft_model_state_dict, sys.modules["peft"].set_peft_model_state_dict)
    state_dict = get(trainer.model)  # a tied weight (lm_head = embed_tokens) is in the file once
    present = {state_dict[k].data_ptr() for k in weights if k in state_dict}
    tied = {k for k in state_dict if k not in weights and state_dict[k].data_ptr() in present}
    theirs, ours = ({k: tuple(v.shape) for k, v in d.items() if k not in tied} for d in (weights, state_dict))
    wrong = [(k, theirs.get(k), ours.get(k)) for k in sorted(theirs | ours) if theirs.get(k) != ours.get(k)]
    require(not wrong, f"{file} is another model's (name, its shape, the model's; None: none): {wrong[:1]}")
    check_trainer_state(trainer, state, os.path.join(path, "trainer_state.pt"))  # before anything loads
    saved = {**state["config"], "world_size": state["world_size"]}
    current = dict(asdict(args), world_size=trainer.world_size, train_dataset=trainer.dataset._fingerprint,
                   adapter=adapter_config(trainer.model))
    for c in (saved, current):  # steps_per_generation None is gradient_accumulation_steps: the same shape
        c["steps_per_generation"] = c.get("steps_per_generation") or c["gradient_accumulation_steps"]
    diff = {k: (saved.get(k), current[k]) for k in shape if saved.get(k) != current[k]}  # .get: older ones
    require(not diff, f"checkpoint {path!r} was written with a different batch shape (then, now): {diff}")
    require(saved.get("adapter", current["adapter"]) == current["adapter"], f"checkpoint {path!r}'s adapter "
            f"was made with another LoRA config (then, now): {saved.get('adapter')} != {current['adapter']}:"
            " its weights would compute another policy. Resume with the same peft_config")
    this_rank, remade = state["ranks"][trainer.rank], [k for k in cached if saved[k] != current[k]]
    require(not remade or this_rank["batch"] is None, f"checkpoint {path!r} is inside a μ cycle whose "
            f"cached batch was made with other {remade}: resume with its values, or from a cycle boundary")
    changed = [f"{k} {v!r} -> {current.get(k)!r}" for k, v in saved.items()
               if v != current.get(k) and k not in ("output_dir", "overwrite_output_dir")]
    if changed:
        warnings.warn(f"resuming {path!r} with another config; the new values apply: {', '.join(changed)}")
    if state["step"] >= args.max_steps:  # (the final model is saved again)
        warnings.warn(f"checkpoint {path!r} at step {state['step']} >= max_steps: nothing is left to train")
    strict = {} if peft else {"strict": False}  # every weight but the tied ones, as checked above
    load(trainer.model, weights, **strict)  # only now: a load that fails has copied the tensors that fit
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.rank == 0:  # once the checkpoint has loaded
        set_aside_after(trainer, state["step"])
    trainer.step, trainer.nonfinite_in_a_row = state["step"], state["nonfinite_in_a_row"]
    trainer.window = defaultdict(list, state.get("window", {}))  # the steps logged by no row yet
    trainer.batch, trainer.samples, rng = this_rank["batch"], this_rank["samples"], this_rank["rng"]
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"].cpu())
    torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"] or []])  # [] on CPUs, None: older ones
    if np_state := rng.get("numpy"):  # (older checkpoints: not saved)
        numpy.random.set_state((np_state[0], numpy.array(np_state[1], numpy.uint32), *np_state[2:]))
    trainer.scheduler = lr_schedule(trainer, state["lr_step"])
    trainer.start_time -= this_rank.get("elapsed", 0.0)  # the clock goes on (earlier versions: not saved)

def check_trainer_state(trainer, state, file):  # what load_checkpoint reads: whole, and this trainer's
    keys = {"step", "optimizer", "ranks", "config", "lr_step", "world_size", "nonfinite_in_a_row"}
    missing = sorted(keys - set(state)) if isinstance(state, dict) else "everything"
    require(not missing, f"{file} lacks {missing}: not a checkpoint of this trainer (or an edited one)")
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    saved = [len(group["params"]) for group in state["optimizer"].get("param_groups", [])]
    require(saved == [len(g["params"]) for g in trainer.optimizer.param_groups], f"{file}'s optimizer state "
            f"is for weights {saved} (per group), this model trains {len(params)}")
    moments = state["optimizer"].get("state", {})  # AdamW's, of every weight that has had a gradient
    require(len(moments) == state.get("moments", len(moments)) and set(moments) <= set(range(len(params))),
            f"{file}'s optimizer state has the moments of {len(moments)} of the {state.get('moments')} saved")
    ranks = state["ranks"]
    rng = ranks[trainer.rank].get("rng", {}) if isinstance(ranks, list) and trainer.rank < len(ranks) else {}
    same = torch.is_tensor(rng.get("torch")) and rng["torch"].numel() == torch.get_rng_state().numel()
    require(same, f"{file}'s random number states are garbled: a resume could not draw the same samples")

def adapter_config(model):  # a PeftModel's adapter config, what its weights mean (None: no adapter), as JSON
    if not is_peft(model):
        return None
    ignored = ("base_model_name_or_path", "revision", "inference_mode", "peft_version")  # not its function
    config = {k: v for k, v in model.peft_config["default"].to_dict().items() if k not in ignored}
    return json.dumps(config, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, set) else str(v))

def set_aside_after(trainer, step):  # what output_dir's run logged after `step`: a roll-back keeps it aside
    out, metrics = trainer.args.output_dir, os.path.join(trainer.args.output_dir, "metrics.jsonl")
    later = [c for c in list_checkpoints(out) if int(c.rsplit("-", 1)[1]) > step]
    rows = pathlib.Path(metrics).read_text().splitlines(keepends=True) if os.path.exists(metrics) else []
    kept = list(itertools.takewhile(lambda row: row.endswith("\n") and json.loads(row)["step"] <= step, rows))
    past = rows[len(kept):]  # and a last line that a crash cut short (no newline)
    if later:  # else save_total_limit or resume_from_checkpoint=True would pick them over this run's own
        aside = tempfile.mkdtemp(prefix=f"rolled-back-to-{step}-", dir=out)
        for p in (moved := later + final_model_files(out)):
            shutil.move(p, aside)
        pathlib.Path(aside, "metrics.jsonl").write_text("".join(past))
        warnings.warn(f"rolling back to step {step}: {', '.join(map(os.path.basename, moved))} and the "
                      f"later metrics are set aside in {aside}")
    if past:  # the resumed run logs these steps again
        pathlib.Path(metrics + ".tmp").write_text("".join(kept))
        os.replace(metrics + ".tmp", metrics)

def final_model_files(out):  # the entries of output_dir that final_model_files.json lists, and itself
    file = pathlib.Path(out, "final_model_files.json")
    with suppress(FileNotFoundError, ValueError):  # none, or not JSON: no files
        names = json.loads(file.read_text())
        if isinstance(names, list) and all(isinstance(n, str) for n in names):  # else a broken list: none
            return [os.path.join(out, n) for n in sorted({*names, file.name} & set(os.listdir(out)))]
    return []

def list_checkpoints(output_dir):  # the complete ones, oldest first (not checkpoint-<step>.tmp), as named
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = {int(n[11:]): n for n in names if n.startswith("checkpoint-") and n[11:].isdecimal()}
    return [os.path.join(output_dir, steps[s]) for s in sorted(steps)]

def final_save_names(trainer):  # the files that the final save writes into output_dir
    with tempfile.TemporaryDirectory() as tmp:
        trainer.tokenizer.save_pretrained(tmp)  # the tokenizer's: saved here to know them (it is small)
        names = set(os.listdir(tmp))
    if is_peft(trainer.model):  # the adapter's, and peft's model card
        return names | {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    return names | {"config.json", "generation_config.json", "model.safetensors"}

def remove(path):  # a file, a folder, or a link (never what it points to)
    (shutil.rmtree if os.path.isdir(path) and not os.path.islink(path) else os.remove)(path)

def require(ok, message, error=ValueError):  # every bad input fails at start or as soon as it shows, named
    if not ok:
        raise error(message)

def check_config(c):  # (scale_rewards=True/False: TRL's older form)
    c.scale_rewards = ("none", "group")[c.scale_rewards] if type(c.scale_rewards) is bool else c.scale_rewards
    for name, hint in typing.get_type_hints(GRPOConfig).items():
        value, kinds = getattr(c, name), typing.get_args(hint) or (hint,)
        kind, optional = typing.get_origin(kinds[0]) or kinds[0], type(None) in kinds
        words = {"true": True, "false": False, "none": None}  # from a command line or YAML ("1e-5")
        if isinstance(value, str) and kind in (int, float, bool, dict) and value.lower() in words:
            value = words[value.lower()]
        elif isinstance(value, str) and kind in (int, float, dict):
            with suppress(ValueError):  # else it stays a string, refused just below
                value = json.loads(value) if kind is dict else kind(value)
        value = float(value) if kind is float and type(value) is int else value
        typed = value is None and optional or isinstance(value, kind) and (kind, type(value)) != (int, bool)
        what = "finite" if typed else "an int" if kind is int else kind.__name__  # inf, nan: never meant
        require(typed and (kind is not float or value is None or math.isfinite(value)),
                f"GRPOConfig.{name}={value!r} must be {what}" + " or None" * (optional and not typed))
        setattr(c, name, value)
    choices = dict(loss_type=("grpo", "bnpo", "dapo", "dr_grpo"), scale_rewards=("group", "none"),
                   lr_scheduler_type=("linear", "constant"), importance_sampling_level=("token", "sequence"))
    rules = {"must be >= 1": (lambda v: v >= 1, "num_iterations max_steps per_device_train_batch_size "
                              "gradient_accumulation_steps max_completion_length logging_steps save_steps "
                              "max_prompt_length save_total_limit steps_per_generation"),
             "must be >= 0": (lambda v: v >= 0, "beta learning_rate weight_decay max_grad_norm"),
             "must be > 0": (lambda v: v > 0, "epsilon_high temperature")}
    checks = [(n, getattr(c, n) is None or ok(getattr(c, n)), rule) for rule, (ok, names) in rules.items()
              for n in names.split()] + [
        ("num_generations", c.num_generations >= 2, "must be >= 2: a group of one has no baseline"),
        ("epsilon", 0 < c.epsilon < 1, "must lie in (0, 1)"),
        ("reward_weights", all(isinstance(w, numbers.Real) and math.isfinite(w)
                               for w in c.reward_weights or []), "must be finite numbers"),
        *[(n, getattr(c, n) in v, f"must be one of {v}") for n, v in choices.items()]]
    for name, ok, rule in checks:
        require(ok, f"GRPOConfig.{name}={getattr(c, name)!r} {rule}")

def check_inputs(args, reward_funcs):
    gas = args.gradient_accumulation_steps
    per_step, spg = args.per_device_train_batch_size * gas, args.steps_per_generation or gas
    require(per_step % args.num_generations == 0, "per_device_train_batch_size × gradient_accumulation_steps"
            f" = {per_step} is not divisible by num_generations={args.num_generations}: groups can't split")
    require(spg % gas == 0, f"steps_per_generation={spg} is not a multiple of gradient_accumulation_steps="
            f"{gas}: a generation batch must hold whole optimizer steps")
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    require(funcs and all(map(callable, funcs)), "reward_funcs must be a function or a non-empty list of "
            f"them, got {reward_funcs!r}", TypeError)
    n = len(args.reward_weights or funcs)  # weights: one per function
    require(n == len(funcs), f"GRPOConfig.reward_weights has {n} weights for {len(funcs)} reward functions")
    with suppress(OSError):
        os.makedirs(args.output_dir, exist_ok=True)
    require(os.path.isdir(args.output_dir) and os.access(args.output_dir, os.W_OK),
            f"output_dir {args.output_dir!r} is not a folder this process can write")
    return funcs

def check_dataset(dataset):  # a map-style datasets.Dataset, or a list of rows like {"prompt": ...}
    rows = isinstance(dataset, list) and all(isinstance(row, dict) for row in dataset)
    require(rows or isinstance(dataset, Dataset), "train_dataset must be a map-style datasets.Dataset "
            "(prompts are drawn by index: no streaming), or a list of rows like {'prompt': ...}; got "
            f"{type(dataset).__name__}", TypeError)
    require(len(dataset) > 0, "train_dataset is empty")
    columns = set(dataset[0]) if rows else set(dataset.column_names)
    require(not rows or all(set(row) == columns for row in dataset),  # from_list would drop the others' keys
            f"train_dataset's rows must all have the keys of its first row, {sorted(columns)}")
    require("prompt" in columns, f"train_dataset has no 'prompt' column (columns: {sorted(columns)})")
    taken = sorted(columns & {"prompts", "completions", "completion_ids"})
    require(not taken, f"train_dataset's columns {taken} are named like reward function arguments: rename")
    prompts = [row["prompt"] for row in dataset] if rows else dataset["prompt"][:]  # a list: one read, not N
    for i, p in enumerate(prompts):
        chat = isinstance(p, list) and p and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                 for m in p)
        require(not isinstance(p, str) or p.strip(), f"train_dataset prompt {i} is an empty string")
        require(isinstance(p, str) or chat, f"train_dataset prompt {i} is neither text nor a conversation (a "
                f"list of {{'role', 'content'}} messages): {p!r:.80}")
        require(isinstance(p, str) == isinstance(prompts[0], str),
                f"train_dataset's prompt column mixes plain text and conversations (prompt {i})")
    return Dataset.from_list(dataset) if rows else dataset

def check_prompt_ids(ids, max_prompt_length):
    if not all(ids):
        raise ValueError(f"prompt {[len(x) for x in ids].index(0)} of this batch renders to 0 tokens")
    if max_prompt_length is not None and any(len(x) > max_prompt_length for x in ids):
        warnings.warn(f"some prompts are longer than max_prompt_length={max_prompt_length} tokens; they keep "
                      "their last max_prompt_length tokens (their beginning is dropped)", stacklevel=3)
    return [x[-max_prompt_length:] for x in ids] if max_prompt_length else ids

def call_reward(f, kwargs):  # f's rewards as a float32 column, NaN for None; else an error naming f
    name, completions = getattr(f, "__name__", repr(f)), kwargs["completions"]
    try:
        values = f(**kwargs)
    except Exception as e:
        raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    listlike = isinstance(values, (list, tuple)) or getattr(values, "ndim", None) == 1  # numpy, torch: 1-d
    require(listlike, f"reward function {name!r} returned a {type(values).__name__} ({values!r:.60}), not a "
            "list of numbers (or None), one per completion", TypeError)
    require(len(values) == len(completions), f"reward function {name!r} returned {len(values)} values for "
            f"{len(completions)} completions; it must return one number (or None) per completion")
    for i, v in enumerate(values):
        number = isinstance(v, numbers.Real) and type(v) is not bool or torch.is_tensor(v) and v.numel() == 1
        require(v is None or number, f"reward function {name!r} returned {v!r} ({type(v).__name__}) for "
                f"completion {i}; rewards must be numbers (or None)", TypeError)
        finite = v is None or abs(v.item() if torch.is_tensor(v) else v) <= torch.finfo(torch.float32).max
        require(finite, f"reward function {name!r} returned {v} for completion {i} ({completions[i]!r:.50}); "
                "rewards must be finite in float32")
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)

def load_policy(model, processing_class, peft_config, args, device):  # checked for what training assumes
    require(isinstance(model, (PreTrainedModel, str, os.PathLike)) or is_peft(model) and peft_config is None,
            "model must be a hub id, a folder, a PreTrainedModel or (without peft_config) a peft.PeftModel, "
            f"got {type(model).__name__}", TypeError)
    require(isinstance(model, (str, os.PathLike)) or not args.model_init_kwargs, "GRPOConfig.model_init_"
            "kwargs are from_pretrained's, for a hub id or a folder: this model is loaded already")
    if isinstance(model, (str, os.PathLike)):  # in float32 unless model_init_kwargs say otherwise
        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype", torch.float32))  # torch_dtype: the older name
        model = from_disk_or_hub(AutoModelForCausalLM, str(model), **kwargs)
    if peft_config is not None:  # peft, an optional dependency, is imported here only
        require(importlib.util.find_spec("peft"), "peft_config needs peft: pip install peft", ImportError)
        with torch.random.fork_rng(devices=[]):  # the adapter's initial weights follow args.seed
            torch.manual_seed(args.seed)
            model = importlib.import_module("peft").get_peft_model(model, peft_config)  # in float32
    model = model.to(device).train()
    peft, names = sys.modules.get("peft"), list(getattr(model, "peft_config", {}))  # (imported by its maker)
    layers = peft and any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in model.modules())
    require(not layers or is_peft(model) and names == ["default"], f"{type(model).__name__}'s adapters "
            f"{names} are outside a PeftModel (peft.inject_adapter_in_model?) or not one named 'default' "
            "(the one checkpointed and saved). Pass the plain model and peft_config, or get_peft_model()")
    check_trainable(model)
    for m in model.modules():  # no dropout: the same weights must give the same log-probs (π_old = π_θ)
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0  # functional
    require(processing_class is not None or model.config._name_or_path,
            "the model was built in memory, so it names no tokenizer: pass processing_class")
    tokenizer = processing_class or from_disk_or_hub(AutoTokenizer, model.config._name_or_path)
    require(len(tokenizer) > len(tokenizer.all_special_ids), "the tokenizer has special tokens only (a model "
            f"folder without tokenizer files? {model.config._name_or_path!r}): pass processing_class")
    require(tokenizer.eos_token_id is not None, "the tokenizer has no eos_token: completions could never end")
    if tokenizer.pad_token_id is None:  # padding is masked out, so any id will do; EOS is the usual choice
        tokenizer.pad_token = tokenizer.eos_token
    vocab = model.get_input_embeddings().weight.shape[0]  # (a LoRA-wrapped embedding has no num_embeddings)
    for name in ("eos_token_id", "pad_token_id"):
        require(0 <= getattr(tokenizer, name) < vocab, f"the tokenizer's {name}={getattr(tokenizer, name)} "
                f"is outside the model's vocabulary of {vocab} tokens: they do not belong together")
    with torch.no_grad():  # per_token_logps computes logits as F.linear(hidden states, lm_head's weights)
        ids, head = torch.tensor([[tokenizer.eos_token_id] * 3], device=device), model.get_output_embeddings()
        head_logits = head(model.get_decoder()(input_ids=ids).last_hidden_state)
        logits = model(input_ids=ids).logits[:, -3:]  # (prompt tuning's virtual tokens come first)
        same = isinstance(head, torch.nn.Linear) and torch.allclose(logits, head_logits, rtol=1e-3, atol=1e-3)
        require(same, f"{type(model).__name__}'s logits are not lm_head(hidden states) (softcapping, "
                "scaling, an adapter on lm_head or the input?): per_token_logps's log-probs would be wrong")
    return model, tokenizer

def check_trainable(model):  # at construction, and at train(): after a trainer.model.to(torch.bfloat16)?
    dtypes = ", ".join(sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})) or "none"
    require(dtypes == "torch.float32", f"{type(model).__name__}'s trainable weights are {dtypes}: train "
            "float32 ones (in 16 bits AdamW's updates round away; bf16=True computes in bfloat16), or LoRA")

def is_peft(model):  # a peft.PeftModel (peft is imported by then): its adapter trains, checkpoints and saves
    return isinstance(model, getattr(sys.modules.get("peft"), "PeftModel", ()))

def reference_model(model):  # π_ref, frozen: a copy of the policy, or a PeftModel itself (adapter disabled)
    return model if is_peft(model) else copy.deepcopy(model).eval().requires_grad_(False)

def eos_token_ids(model, tokenizer):  # TRL's: any of the tokenizer's and generation_config's EOS ids ends
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return torch.tensor(sorted({tokenizer.eos_token_id, *ids}), device=model.device)

def from_disk_or_hub(cls, name, **kwargs):  # hub unreachable: the local cache only, to fail in seconds
    local = os.path.isdir(name)
    require(local or not (os.path.isabs(name) or name[:1] == "."), f"could not load {name!r}: no such folder")
    offline = not local and not hub_reachable()  # (peft's adapter lookup ignores local_files_only: below)
    kwargs |= {"adapter_kwargs": {"local_files_only": offline}} if cls is AutoModelForCausalLM else {}
    kwargs.setdefault("trust_remote_code", False)  # a folder's own Python runs only if asked for by name
    try:
        return cls.from_pretrained(name, local_files_only=offline, **kwargs)
    except OSError as e:
        where = ("the hub is unreachable and it is not in the local cache" if offline else "the folder "
                 "holds no model of this kind" if local else "it is no local folder, and the hub has none")
        raise ValueError(f"could not load {name!r}: {where} ({str(e).splitlines()[0]})") from None
    except ValueError as e:
        require("trust_remote_code" not in str(e) or kwargs["trust_remote_code"], f"{name!r} asks to run its "
                "own code (its config's auto_map), which runs only if asked for: if you trust it, pass "
                "GRPOConfig(model_init_kwargs={'trust_remote_code': True}) (and a processing_class)")
        raise
    except TypeError as e:  # a keyword that neither from_pretrained nor the model takes (a misspelling?)
        require(cls is not AutoModelForCausalLM, f"could not load {name!r}: GRPOConfig.model_init_kwargs "
                f"holds a keyword that from_pretrained and the model do not take ({e})")
        raise

def hub_reachable(timeout=3.0):  # one HEAD request with huggingface_hub's client: its proxy, certificates
    with suppress(Exception):  # no answer in time: unreachable (any HTTP status, 404 too, is an answer)
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() not in ("1", "true", "yes"):
            huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=timeout)
            return True
    return False

def check_versions():  # the requirements' lower bounds: older versions fail deep inside, unnamed
    from packaging.version import Version
    for module, need in ((torch, "2.4"), (sys.modules["transformers"], "5.24")):  # (imported above)
        found = module.__version__.split("+")[0]  # "2.13.0+cpu"
        require(Version(found) >= Version(need), f"grpo_multistep needs {module.__name__} >= {need} (the "
                f"requirements' range), found {found}: pip install '{module.__name__}>={need}'", ImportError)

check_versions()
