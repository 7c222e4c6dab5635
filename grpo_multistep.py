"""GRPO with multi-step (μ) optimization, in one file: the idea of TRL PR #2899, "6x faster GRPO with
multi-step optimization", written from scratch to be read and copied.

GRPO (DeepSeekMath's Algorithm 1) trains a language model on rewards. For each prompt q it samples a group
of G completions o_1..o_G from the current policy π_old, scores them, and gives every token of o_i the
advantage A_i = (r_i - mean(r)) / (std(r) + 1e-4), with the mean and std taken over the group. The
multi-step trick reuses one batch of generations for μ = num_iterations optimizer steps. After the first
step π_θ is no longer π_old, so each token's term is weighed by the ratio ρ_t = π_θ(o_t) / π_old(o_t),
with π_old's log-probs cached once, and clipped as in PPO:

    loss_t = -min(ρ_t · A, clip(ρ_t, 1 - ε, 1 + ε_high) · A) + β · KL_t(π_θ ‖ π_ref)

A generation batch may hold S steps' worth of completions, each of its S mini-batches used μ times (μ·S
steps, S = steps_per_generation / gradient_accumulation_steps). Part I: Algorithm 1. Part II: the trainer.
"""
import contextlib, copy, dataclasses, functools, importlib, json, math, os, random, shutil, sys
from collections import defaultdict

import numpy, safetensors.torch, torch
from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers >= 5.24: models take `cache=`.

# ========================================= PART I: THE ALGORITHM =========================================
# ---- 1. Generation: for each prompt q, sample G completions o_1..o_G ~ π_old(· | q) --------------------
def tokenize_prompts(tokenizer, prompts, max_prompt_length):
    """Texts get the tokenizer's special tokens (a BOS), as in TRL; conversations the chat template's. Each
    keeps its last max_prompt_length tokens, padded on the left: every completion starts in one column."""
    chat = not isinstance(prompts[0], str)
    if chat:
        prompts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompts, add_special_tokens=not chat)["input_ids"]
    if max_prompt_length is not None:
        ids = [x[-max_prompt_length:] for x in ids]
    padded = tokenizer.pad({"input_ids": ids}, padding_side="left", return_tensors="pt")
    return padded["input_ids"], padded["attention_mask"]                                   # (B, P) each

def position_ids(attention_mask):  # Positions count real tokens only, so left padding shifts nothing.
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)                                    # (B, T)

def completion_mask(completion_ids, eos_token_ids):
    """1 up to and including the first EOS (any of eos_token_ids), 0 after it. It goes by position, not by
    token id, so that the EOS itself is trained even where the pad token is the EOS token."""
    eos = torch.as_tensor(eos_token_ids, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos).long()                                        # (B, C)
    eos_before = is_eos.cumsum(1) - is_eos  # How many EOS tokens came before each position.
    return (eos_before == 0).long()                                                        # (B, C)

def sample_token(logits, temperature):
    """One token per row from exactly softmax(logits / T), one uniform number per row (by inverse CDF)."""
    cdf = (logits.float() / temperature).softmax(-1).double().cumsum(-1)                 # (n, V)
    u = torch.rand(len(cdf), 1, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]      # (n, 1)
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp(max=cdf.size(1) - 1)  # (n,)

@torch.no_grad()
def generate_completions(model, tokenizer, prompt_ids, prompt_mask, args, eos_token_ids):
    """G completions per prompt, token by token with the KV cache, from softmax(logits / T) alone (no top-k
    or top-p: section 3's log-probs describe what sampled, up to rounding), each ending at its first EOS.
    Returns the prompts repeated G times (B·G, P), their mask, the completions (B·G, C) and their mask."""
    G = args.num_generations
    eos = torch.as_tensor(eos_token_ids, device=prompt_ids.device)
    positions = position_ids(prompt_mask)                                                  # (B, P)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    out.cache.batch_repeat_interleave(G)  # Each prompt runs once; its G completions copy its KV cache.
    logits = out.logits[:, -1].repeat_interleave(G, 0)                                     # (B·G, V)
    mask = prompt_mask.repeat_interleave(G, 0)                                             # (B·G, P)
    position = positions[:, -1:].repeat_interleave(G, 0)                                  # (B·G, 1)
    done = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)                   # (B·G,)
    tokens = []
    for t in range(args.max_completion_length):
        token = sample_token(logits, args.temperature).masked_fill(done, tokenizer.pad_token_id)
        tokens.append(token)
        done = done | torch.isin(token, eos)
        if done.all() or len(tokens) == args.max_completion_length:  # (The last needs no logits.)
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)                         # (B·G, P+t+1)
        position = position + 1
        logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                       cache=out.cache, use_cache=True).logits[:, -1]                      # (B·G, V)
    completion_ids = torch.stack(tokens, 1)                                                # (B·G, C)
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion_ids,
            completion_mask(completion_ids, eos))

# ---- 2. Rewards r_i and group-normalized advantages A_i ------------------------------------------------
def score_completions(reward_funcs, prompts, completions, completion_ids, columns):
    """Each reward function is called as in TRL, f(prompts=, completions=, completion_ids=, **columns), and
    returns a number per completion, or None ("does not apply"): (N, F) rewards, NaN for None."""
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    rewards_per_func = torch.stack([call_reward(f, copy.deepcopy(kwargs)) for f in reward_funcs], 1)
    unscored = rewards_per_func.isnan().all(1).nonzero()[:, 0].tolist()  # Else its reward would be 0.
    require(not unscored, f"every reward function returned None or NaN for completion {unscored[:1]}")
    return rewards_per_func                                                                # (N, F)

def group_advantages(rewards, num_generations, scale_rewards="group"):
    """A_i = (r_i - mean(r)) / (std(r) + 1e-4) within each group, with the unbiased (G - 1) std as in TRL.
    rewards: (N,), one total per completion; a prompt's G completions are adjacent rows. scale_rewards='none'
    (Dr. GRPO's choice) leaves out the division; 'group' is the default here and in TRL."""
    shape_ok = rewards.dim() == 1 and len(rewards) % num_generations == 0  # (N, F) would mix functions.
    require(shape_ok, f"rewards of shape {tuple(rewards.shape)} must be (N,), N a multiple of "
            f"num_generations={num_generations}")
    require(scale_rewards in ("group", "none"), f"scale_rewards={scale_rewards!r} must be 'group' or 'none'")
    grouped = rewards.view(-1, num_generations)                                            # (B, G)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    # A group of equal rewards carries no signal: exactly 0, which a float mean of equal numbers can miss.
    all_equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return advantages.masked_fill(all_equal, 0.0).view(-1)                                 # (B·G,)

# ---- 3. Per-token log-probs log π(o_t | q, o_<t), and the batch cut for the optimizer steps ------------
def per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """log π(o_t | q, o_<t) by its definition: one pass over prompt and completion; the logits before each
    completion token give log_softmax(logits / T) at it (T: the sampling's), and its entropy. (b, C) each."""
    mask = torch.cat([prompt_mask, completion_mask], 1)                                    # (b, P+C)
    C = completion_ids.size(1)
    logits = model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                   position_ids=position_ids(mask), logits_to_keep=C + 1).logits[:, :-1]  # (b, C, V)
    log_probs = (logits.float() / temperature).log_softmax(-1)                             # (b, C, V)
    entropy = -(log_probs.exp() * log_probs).sum(-1).detach()                              # (b, C)
    return log_probs.gather(-1, completion_ids[..., None]).squeeze(-1), entropy

def rows(batch, start, stop):  # Rows [start, stop) of every per-completion tensor; numbers stay whole.
    return {k: v[start:stop] if v.dim() > 0 else v for k, v in batch.items()}

def mini_batches_per_generation(args):  # S: optimizer steps' worth of completions in a generation batch
    return (args.steps_per_generation or args.gradient_accumulation_steps) // args.gradient_accumulation_steps

def mini_batches(batch, S):  # A generation batch cut into its S mini-batches: one step's completions each.
    n = len(batch["completion_mask"]) // S
    return [rows(batch, j * n, (j + 1) * n) for j in range(S)]

def micro_batches(batch, size):
    """A mini-batch cut into micro-batches of `size` completions, one forward and backward pass each
    (gradient accumulation), each cut to its longest prompt and completion: padding only costs compute."""
    for start in range(0, len(batch["completion_mask"]), size):
        mb = rows(batch, start, start + size)
        longest_prompt = int(mb["prompt_mask"].sum(1).max())
        longest_completion = max(1, int(mb["completion_mask"].sum(1).max()))
        for k, v in mb.items():  # Prompts are padded on the left: they keep their last columns.
            if k.startswith("prompt"):
                mb[k] = v[:, v.size(1) - longest_prompt:]
            elif v.dim() == 2:
                mb[k] = v[:, :longest_completion]
        yield mb

# ---- 4. The objective: the clipped surrogate and the KL penalty, for one micro-batch ------------------
def grpo_loss(logps, old_logps, ref_logps, advantages, mask, args, num_seqs, num_tokens):
    """The GRPO objective, negated. logps, old_logps, ref_logps, mask: (b, C); advantages: (b,). args needs
    epsilon and beta; a field it lacks takes this file's GRPOConfig default (loss_type 'grpo', epsilon_high
    None, importance_sampling_level 'token', use_bias_correction_kl False, max_completion_length 256).
    num_seqs and num_tokens count one optimizer step's completions and tokens over its micro-batches and
    processes (with S > 1: the generation batch's, divided by S), so the micro-batches' losses add up."""
    epsilon_low = args.epsilon
    epsilon_high = getattr(args, "epsilon_high", None) or epsilon_low     # None: the same as epsilon
    A = advantages[:, None]                                                # (b, 1): one A per completion
    log_ratio = logps - old_logps                                          # log ρ_t = log π_θ - log π_old
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        # GSPO (a paper's variant): one ratio per completion, the geometric mean of its tokens' ratios.
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    # The ratio ρ. With μ·S = 1, old_logps is logps.detach(), so ρ = exp(0) = 1 in value, yet its gradient
    # is ρ · ∇log π_θ = ∇log π_θ: the term -ρA has exactly the policy gradient -A · ∇log π_θ.
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)         # clip(ρ, 1 - ε, 1 + ε_high)
    # The clipped surrogate. Where ρ has left the clip range in the direction that A pushes it, min()
    # picks the constant clip(ρ)·A: that token stops pushing, which keeps μ steps on one batch near π_old.
    per_token_loss = -torch.min(coef_1 * A, coef_2 * A)
    if args.beta > 0:
        # The KL penalty, by the k3 estimator: π_ref/π_θ - log(π_ref/π_θ) - 1, which is >= 0.
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        if getattr(args, "use_bias_correction_kl", False):  # The tokens came from π_old: weigh by ρ.
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + args.beta * per_token_kl
    # How the tokens' terms average into the loss. DAPO and Dr. GRPO are papers that changed GRPO's way.
    loss_type = getattr(args, "loss_type", "grpo")
    if loss_type == "grpo":  # GRPO's: the mean over each completion's tokens, then over completions.
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    elif loss_type == "bnpo":  # TRL PR #2899's: each micro-batch's token mean, weighed by its share.
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) * len(mask) / num_seqs
    elif loss_type == "dapo":  # DAPO's: the step's token sum over num_tokens (at least 1, as in TRL).
        loss = (per_token_loss * mask).sum() / num_tokens.clamp(min=1)
    elif loss_type == "dr_grpo":  # Dr. GRPO's: a constant divisor, so no completion's length changes weight.
        loss = (per_token_loss * mask).sum() / (num_seqs * getattr(args, "max_completion_length", 256))
    else:  # A misspelt name would otherwise fall silently into one of the branches above.
        raise ValueError(f"loss_type={loss_type!r} must be 'grpo', 'bnpo', 'dapo' or 'dr_grpo'")
    with torch.no_grad():  # The clipped tokens: those whose gradient the clip removed.
        stats = {"clip_low": ((coef_1 < 1 - epsilon_low) & (A < 0) & (mask > 0)).sum(),
                 "clip_high": ((coef_1 > 1 + epsilon_high) & (A > 0) & (mask > 0)).sum()}
        if args.beta > 0:
            stats["kl"] = (per_token_kl * mask).sum()
    return loss, stats

# ---- 5. The μ-iteration loop: generate, score, cache, then μ·S optimizer steps -------------------------
class GRPOLoop:
    """Algorithm 1's loop and its steps; GRPOTrainer (Part II) gives it the model, π_ref, AdamW and more."""

    def train(self, resume_from_checkpoint=None):
        """Algorithm 1: a generation batch is sampled, scored and cached once, then serves μ·S steps."""
        self.start_run(resume_from_checkpoint)  # Checks, then a fresh run or a resume (Part II).
        S = mini_batches_per_generation(self.args)
        steps_per_batch = self.args.num_iterations * S
        while self.step < self.args.max_steps:
            metrics = dict.fromkeys(self.sampled_names, math.nan)  # A step that reuses a batch samples none.
            if self.step % steps_per_batch == 0:  # Time for a new generation batch: sections 1 to 3.
                self.batch, metrics = self.generate_and_score(self.step // steps_per_batch)
                self.sampled_names = list(metrics)
            j = self.step % steps_per_batch  # This step is pass j // S of μ, on mini-batch j % S.
            metrics.update(self.optimizer_step(mini_batches(self.batch, S)[j % S]))
            self.end_of_step(metrics)  # Evaluate, log and checkpoint (Part II).
        self.save_final_model()
        return self

    def generate_and_score(self, k):
        """Sections 1 to 3 for batch k: its completions, rewards, advantages and cached log-probs."""
        args = self.args
        S = mini_batches_per_generation(args)
        seed_random_generators(self, "train", k)  # Its draws depend on k alone, so a resume repeats them.
        sample = self.sample_and_score(self.train_dataset, prompt_rows(self, k))
        advantages = group_advantages(sample["rewards"], args.num_generations, args.scale_rewards)
        mask = sample["completion_mask"]
        if args.mask_truncated_completions:  # DAPO's overlong filtering: completions cut short get no loss.
            mask = mask * ~sample["truncated"][:, None]
        # The loss's normalizers: one step's completions and tokens over all processes (S steps: ÷ S).
        num_seqs = self.all_reduce(torch.tensor(float(len(mask)), device=self.device)) / S
        num_tokens = self.all_reduce(mask.sum().float()) / S
        batch = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"],
                 "completion_ids": sample["completion_ids"], "completion_mask": mask,
                 "advantages": advantages.to(self.device), "num_seqs": num_seqs, "num_tokens": num_tokens}
        # 3. Log-probs, cached once per generation batch. π_old's are needed only if some step is not the
        # batch's first: with μ·S = 1 the training pass's own log-probs, detached, are π_old's.
        if args.num_iterations * S > 1:
            batch["old_logps"] = self.cached_logps(self.model, batch)
        if args.beta > 0:
            with reference_weights(self.ref_model):  # With LoRA, π_ref is the model with its adapter off.
                batch["ref_logps"] = self.cached_logps(self.ref_model, batch)
        return batch, batch_metrics(self, sample)

    def sample_and_score(self, dataset, indices):
        """Sections 1 and 2 for the prompts dataset[indices]: training's, or evaluate()'s held-out ones."""
        G = self.args.num_generations
        columns = dataset.select(indices).to_dict()                                       # {name: values}
        prompts = columns.pop("prompt")
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompts, self.args.max_prompt_length)
        prompt_ids, prompt_mask, completion_ids, mask = generate_completions(
            self.model, self.tokenizer, prompt_ids.to(self.device), prompt_mask.to(self.device), self.args,
            self.eos_token_ids)
        lengths = mask.sum(1)                                                              # (N,)
        ids = [row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())]       # to the 1st EOS
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = texts
        if not isinstance(prompts[0], str):  # A conversation's completion is an assistant message.
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        prompts = [p for p in prompts for _ in range(G)]  # Each prompt beside each of its completions.
        columns = {name: [v for v in values for _ in range(G)] for name, values in columns.items()}
        rewards_per_func = score_completions(self.reward_funcs, prompts, completions, ids, columns)  # (N, F)
        weights = torch.tensor(self.args.reward_weights or [1.0] * len(self.reward_funcs))  # (F,)
        return {"prompts": prompts, "texts": texts, "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                "completion_ids": completion_ids, "completion_mask": mask, "lengths": lengths,
                "rewards_per_func": rewards_per_func,
                "rewards": (rewards_per_func * weights).nansum(1),                  # r_i = Σ_f w_f r_if
                "truncated": ~torch.isin(completion_ids, self.eos_token_ids).any(1)}  # no EOS: cut short

    @torch.no_grad()
    def cached_logps(self, model, batch):
        """π_old's or π_ref's log-probs. They must be cut into the same micro-batches as training's (a row's
        padding follows its micro-batch's longest), or a batch's first ratio would not be exactly 1."""
        width = batch["completion_ids"].size(1)
        parts = []
        for mb in micro_batches(batch, self.args.per_device_train_batch_size):
            logps, _ = self.logps(model, mb)                                                # (b, c)
            parts.append(torch.nn.functional.pad(logps, (0, width - logps.size(1))))  # Zeros: masked out.
        return torch.cat(parts)                                                             # (N, C)

    def logps(self, model, mb):  # Section 3 on a micro-batch; grpo_long_runs.py swaps in a faster pass.
        return per_token_logps(model, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"],
                               mb["completion_mask"], self.args.temperature)

    def optimizer_step(self, batch):
        """One optimizer step on a mini-batch: forward passes, the clipped loss, backward, then AdamW."""
        args = self.args
        sums = defaultdict(float)
        for mb in micro_batches(batch, args.per_device_train_batch_size):  # Gradient accumulation.
            logps, entropy = self.logps(self.model, mb)                                     # (b, c) each
            old_logps = mb.get("old_logps")  # π_old: cached, or with μ·S = 1 the current log-probs.
            if old_logps is None:
                old_logps = logps.detach()
            loss, stats = grpo_loss(logps, old_logps, mb.get("ref_logps"), mb["advantages"],
                                    mb["completion_mask"], args, batch["num_seqs"], batch["num_tokens"])
            loss.backward()
            stats.update(loss=loss.detach(), tokens=mb["completion_mask"].sum(),
                         entropy=(entropy * mb["completion_mask"]).sum())  # The policy's, for a metric.
            for k, v in stats.items():
                sums[k] = sums[k] + v  # Tensors, added where they are: read once per step.
        metrics = step_metrics(self, sums)
        metrics["grad_norm"] = self.update()
        return metrics

    def update(self):  # Clip the gradients (a NaN stops here), then AdamW's step: the step is finished.
        max_norm = self.args.max_grad_norm or math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, error_if_nonfinite=True)
        for group in self.optimizer.param_groups:  # The config's rate at this step (Part II).
            group.update(lr=learning_rate(self.args, self.step), weight_decay=self.args.weight_decay)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return float(grad_norm)

# ======================================= PART II: THE ENGINEERING =======================================
# The config, with TRL's names; docs/reference.md sets each default beside TRL 1.16's.
def arg(default, help, choices=None):  # A field with its --help text: train_tldr.py makes each a flag.
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})

@dataclasses.dataclass
class GRPOConfig:
    output_dir: str = arg("grpo-output", "Where metrics, checkpoints and the final model go.")
    learning_rate: float = arg(1e-6, "AdamW learning rate.")
    weight_decay: float = arg(0.0, "AdamW weight decay, of every trained weight (biases and norms too).")
    lr_scheduler_type: str = arg("linear", "Decay the rate to 0 at max_steps or not.", ("linear", "constant"))
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0: no clipping).")
    max_steps: int = arg(100, "Number of optimizer steps.")
    per_device_train_batch_size: int = arg(8, "Completions per forward-backward pass (micro-batch).")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.")
    seed: int = arg(42, "Seed of the prompt order, the sampling and a LoRA adapter's first weights.")
    num_generations: int = arg(8, "G: completions sampled per prompt (the group).")
    max_prompt_length: int | None = arg(512, "Prompts keep their last this many tokens (None: all).")
    max_completion_length: int = arg(256, "Most tokens generated per completion.")
    temperature: float = arg(1.0, "Sampling temperature; the log-probs use the same one.")
    num_iterations: int = arg(1, "μ: optimizer steps on each mini-batch of a generation batch.")
    steps_per_generation: int | None = arg(None, "Micro-batches per generation (None: one step's).")
    epsilon: float = arg(0.2, "Lower clip: a token with A < 0 stops pushing below a ratio of 1 - epsilon.")
    epsilon_high: float | None = arg(None, "Upper clip: A > 0 stops above 1 + epsilon_high (None: epsilon).")
    beta: float = arg(0.0, "KL coefficient; 0 loads no reference model at all.")
    use_bias_correction_kl: bool = arg(False, "Weigh the KL term by the ratio ρ (TRL 1.16's default: True).")
    loss_type: str = arg("grpo", "How tokens average into the loss.", ("grpo", "bnpo", "dapo", "dr_grpo"))
    importance_sampling_level: str = arg("token", "Token or sequence ratios (GSPO).", ("token", "sequence"))
    mask_truncated_completions: bool = arg(False, "No loss on completions cut at max_completion_length.")
    scale_rewards: str = arg("group", "Divide advantages by their group's std, or not.", ("group", "none"))
    reward_weights: list[float] | None = arg(None, "One weight per reward function (None: all 1).")
    logging_steps: int = arg(10, "Log averaged metrics every this many optimizer steps.")
    eval_strategy: str = arg("no", "Score eval_dataset every eval_steps, or never.", ("no", "steps"))
    eval_steps: int | None = arg(None, "Optimizer steps between evaluations (None: logging_steps).")
    save_strategy: str = arg("steps", "Checkpoints every save_steps and at the end, or no.", ("steps", "no"))
    save_steps: int = arg(500, "Write a checkpoint every this many optimizer steps.")

    def __post_init__(self):
        check_config(self)

LOWEST = dict(num_generations=2, seed=0, steps_per_generation=1, eval_steps=1)  # Other ints 1, floats 0.

def check_config(c):  # Values that would fail deep inside torch, or silently differ (None: unset).
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        field = f"GRPOConfig.{f.name}={value!r}"
        low = LOWEST.get(f.name, {int: 1, float: 0}.get(type(f.default)))  # By the default's type.
        require(low is None or value is None or value >= low, f"{field} must be >= {low}")
        choices = f.metadata["choices"]  # A misspelt name would silently mean another choice.
        require(choices is None or value in choices, f"{field} must be one of {choices}")
    require(c.temperature > 0, f"GRPOConfig.temperature={c.temperature!r} must be > 0")
    require(0 < c.epsilon < 1, f"GRPOConfig.epsilon={c.epsilon!r} must lie in (0, 1)")
    require(c.epsilon_high is None or c.epsilon_high > 0, f"epsilon_high={c.epsilon_high} must be > 0")
    per_step = c.per_device_train_batch_size * c.gradient_accumulation_steps
    require(per_step % c.num_generations == 0, f"per_device_train_batch_size × gradient_accumulation_steps "
            f"= {per_step} is not divisible by num_generations={c.num_generations}: a group would be split")
    spg = c.steps_per_generation or c.gradient_accumulation_steps
    require(spg % c.gradient_accumulation_steps == 0, f"steps_per_generation={spg} is not a multiple of "
            f"gradient_accumulation_steps={c.gradient_accumulation_steps}: a generation batch is whole steps")

def require(ok, message, error=ValueError):  # A check that fails names the input at fault.
    if not ok:
        raise error(message)

# The trainer, as in TRL: GRPOTrainer(model, reward_funcs, args, train_dataset).train() runs Part I's loop.
class GRPOTrainer(GRPOLoop):
    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None):
        self.args = args if args is not None else GRPOConfig()
        self.rank, self.world_size = 0, 1  # One process; grpo_long_runs.py runs several under torchrun.
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        self.train_dataset = check_dataset(train_dataset, "train_dataset")
        self.eval_dataset = None if eval_dataset is None else check_dataset(eval_dataset, "eval_dataset")
        self.model, self.tokenizer = load_policy(model, processing_class, peft_config, self.args, self.device)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)  # The tokenizer's and the model's.
        self.ref_model = reference_model(self.model) if self.args.beta > 0 else None  # π_ref, for β > 0.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=self.args.learning_rate, fused=True)
        self.step = 0  # Optimizer steps taken; train() starts it anew, or from a checkpoint's.

    def all_reduce(self, x):  # The sum over processes: x itself here; grpo_long_runs.py runs several.
        return x

    def start_run(self, resume_from_checkpoint):  # A fresh run's state (AdamW's too), or a checkpoint's.
        check_config(self.args)  # Fields may have changed since the trainer was made.
        weights = self.args.reward_weights or self.reward_funcs
        require(len(weights) == len(self.reward_funcs), f"reward_weights={self.args.reward_weights} needs "
                f"one weight per reward function ({len(self.reward_funcs)})")
        require(self.args.eval_strategy == "no" or self.eval_dataset is not None, "eval_strategy='steps' "
                "needs an eval_dataset")
        # In 16 bits, AdamW's small updates would round away: what trains is float32.
        dtypes = sorted({str(p.dtype) for p in self.model.parameters() if p.requires_grad})
        require(dtypes == ["torch.float32"], f"trainable weights are {dtypes}: train in float32 or with LoRA")
        require(self.args.beta == 0 or self.ref_model is not None, "beta was 0 when the trainer was made, so "
                "it has no reference model: make a new trainer")
        os.makedirs(self.args.output_dir, exist_ok=True)
        self.optimizer.state.clear()  # No moments of an earlier train(),
        self.optimizer.zero_grad(set_to_none=True)  # nor half a gradient that an interruption left.
        self.step = 0
        self.sampled_names = []  # The metrics of a generation batch: NaN in the steps that reuse it.
        self.window = defaultdict(list)  # The metrics of the steps since the last logged row.
        if resume_from_checkpoint is True:  # As in HF's Trainer: the newest, whichever run wrote it.
            found = list_checkpoints(self.args.output_dir)
            require(found, f"{self.args.output_dir!r} holds no checkpoint to resume: start a fresh run")
            resume_from_checkpoint = found[-1]
        if resume_from_checkpoint:
            self.load_checkpoint(resume_from_checkpoint)
        elif self.rank == 0:  # A fresh run's rows start anew.
            open(os.path.join(self.args.output_dir, "metrics.jsonl"), "w").close()

    def evaluate(self):  # The held-out reward, sampled as training's; batches seed anew: no update changes.
        seed_random_generators(self, "eval", 0)
        prompts = list(range(self.rank, len(self.eval_dataset), self.world_size))
        size = len(prompt_rows(self, 0))
        samples = [self.sample_and_score(self.eval_dataset, prompts[i:i + size])
                   for i in range(0, len(prompts), size)]
        sample = {k: torch.cat([s[k] for s in samples]) for k in ("rewards", "rewards_per_func", "lengths",
                                                                  "truncated")}
        return {f"eval_{k}": v for k, v in batch_metrics(self, sample).items()}

    def end_of_step(self, metrics):  # After each step: evaluate, log and checkpoint, in that order as in TRL.
        args = self.args
        if args.eval_strategy == "steps" and self.step % (args.eval_steps or args.logging_steps) == 0:
            metrics.update(self.evaluate())
        for k, v in metrics.items():
            self.window[k].append(v)
        last = self.step == args.max_steps
        if self.step % args.logging_steps == 0 or last:
            self.log(self.logged_row())
        if args.save_strategy == "steps" and (self.step % args.save_steps == 0 or last):
            self.save_checkpoint()

    def logged_row(self):  # Each metric's mean over the steps since the last row: NaN where none sampled.
        row = {"step": self.step}
        for k, values in self.window.items():
            present = [v for v in values if not math.isnan(v)]
            row[k] = sum(present) / len(present) if present else math.nan
        self.window.clear()
        return row

    def log(self, row):  # Rank 0 prints the row and appends it to metrics.jsonl (JSON has no NaN: null).
        if self.rank == 0:
            finite = {k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}
            with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(finite) + "\n")
            print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))

    # Checkpoints: the model's (or adapter's) safetensors, optimizer.pt, trainer_state.json, metrics.jsonl
    # and a rank_<r>.pt per process with its generation batch, which the batch's later steps reuse.
    def save_checkpoint(self):
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.step}")
        tmp = folder + ".tmp"  # Renamed once whole: a checkpoint is complete or absent.
        os.makedirs(tmp, exist_ok=True)
        torch.save({k: v.cpu() for k, v in self.batch.items()}, os.path.join(tmp, f"rank_{self.rank}.pt"))
        if self.rank == 0:  # The files that every process shares, then the rename.
            self.model.save_pretrained(tmp)
            torch.save(self.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
            shutil.copy(os.path.join(self.args.output_dir, "metrics.jsonl"), tmp)  # The rows up to this step.
            state = {"step": self.step, "window": self.window, "sampled_names": self.sampled_names,
                     "config": dict(dataclasses.asdict(self.args), world_size=self.world_size)}
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump(state, f, default=str)  # A Path as a string.
            shutil.rmtree(folder, ignore_errors=True)  # This step's checkpoint from an earlier try, if any.
            os.replace(tmp, folder)

    def load_checkpoint(self, path):  # JSON and tensors only (torch.load's weights_only): no code runs.
        with open(os.path.join(path, "trainer_state.json")) as f:  # All is read before the weights change.
            state = json.load(f)
        then, now = state["config"], dict(dataclasses.asdict(self.args), world_size=self.world_size)
        shape = ("num_iterations", "steps_per_generation", "num_generations", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "world_size", "seed")  # What the prompt order follows.
        changed = {k: (then[k], now[k]) for k in shape if then[k] != now[k]}
        require(not changed, f"checkpoint {os.fspath(path)!r} has another batch shape (then, now): {changed}")
        weights_file = "adapter_model.safetensors" if is_peft(self.model) else "model.safetensors"
        weights = safetensors.torch.load_file(os.path.join(path, weights_file), device=str(self.device))
        if not is_peft(self.model):  # Tied weights are saved once: each other one, and nothing else.
            wrong = set(weights) ^ (set(self.model.state_dict()) - set(self.model.all_tied_weights_keys))
            require(not wrong, f"{os.fspath(path)!r} holds another model's weights ({sorted(wrong)[:2]})")
        load = functools.partial(torch.load, map_location=self.device, weights_only=True)
        optimizer = load(os.path.join(path, "optimizer.pt"))
        self.batch = load(os.path.join(path, f"rank_{self.rank}.pt"))
        if self.rank == 0:  # The rows up to the checkpoint: the resumed run logs the later steps again.
            shutil.copy(os.path.join(path, "metrics.jsonl"), self.args.output_dir)
        if is_peft(self.model):
            sys.modules["peft"].set_peft_model_state_dict(self.model, weights)
        else:
            self.model.load_state_dict(weights, strict=False)  # Not strict: the tied weights are absent.
        self.optimizer.load_state_dict(optimizer)
        self.step = state["step"]
        self.window = defaultdict(list, state["window"])
        self.sampled_names = state["sampled_names"]

    def save_final_model(self):  # For from_pretrained(output_dir): the model, or the adapter, and tokenizer.
        if self.rank == 0:
            self.model.save_pretrained(self.args.output_dir)
            self.tokenizer.save_pretrained(self.args.output_dir)

def list_checkpoints(output_dir):  # The complete ones, oldest first (not checkpoint-<step>.tmp).
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = [int(n[11:]) for n in names if n.startswith("checkpoint-") and n[11:].isdecimal()]
    return [os.path.join(output_dir, f"checkpoint-{step}") for step in sorted(steps)]

def learning_rate(args, step):  # TRL's linear decay to 0 at max_steps, or a constant rate.
    decay = (args.max_steps - step) / args.max_steps if args.lr_scheduler_type == "linear" else 1.0
    return args.learning_rate * decay

# Generation batch k's prompts are a function of k alone, so that a resume picks the same; a process takes its
# share of each step. This order, the seeding below and load_checkpoint's batch-shape check change together.
def prompt_rows(trainer, k):
    args = trainer.args
    n = len(trainer.train_dataset)
    S = mini_batches_per_generation(args)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    indices = []
    for j in range(S):
        first = ((k * S + j) * trainer.world_size + trainer.rank) * per_step
        for i in range(first, first + per_step):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + 1000003 * (i // n)))
            indices.append(int(perm[i % n]))  # Epoch i // n's shuffle, which no seed a little apart repeats.
    return indices

def seed_random_generators(trainer, purpose, k):  # Per batch and process: no random state to save.
    entropy = [trainer.args.seed, ("train", "eval").index(purpose), k, trainer.rank]
    seed = int(numpy.random.SeedSequence(entropy).generate_state(1)[0])
    random.seed(seed)
    numpy.random.seed(seed)  # For reward functions that draw from numpy.
    torch.manual_seed(seed)

def batch_metrics(trainer, sample):  # TRL's names; means over the processes, in one all-reduce.
    grouped = sample["rewards"].view(-1, trainer.args.num_generations)                      # (B, G)
    flat = grouped.max(1).values == grouped.min(1).values  # Groups with no signal (section 2).
    metrics = {"reward": grouped.mean(), "reward_std": grouped.std(1).mean(),
               "frac_reward_zero_std": flat.float().mean(),
               "completions/mean_length": sample["lengths"].float().mean(),
               "completions/clipped_ratio": sample["truncated"].float().mean()}  # Cut at the length.
    for i, f in enumerate(trainer.reward_funcs):
        name = getattr(f, "__name__", type(f).__name__)
        metrics[f"rewards/{name}/mean"] = sample["rewards_per_func"][:, i].nanmean()
    values = torch.stack([v.float().to(trainer.device) for v in metrics.values()])
    return dict(zip(metrics, (trainer.all_reduce(values) / trainer.world_size).tolist()))

def step_metrics(trainer, sums):  # Sums over micro-batches and processes; all but the loss per token.
    s = dict(zip(sums, trainer.all_reduce(torch.stack([v.float() for v in sums.values()])).tolist()))
    tokens = max(s["tokens"], 1.0)  # 0 where every completion was masked.
    metrics = {"loss": s["loss"], "learning_rate": learning_rate(trainer.args, trainer.step),
               "entropy": s["entropy"] / tokens, "clip_ratio/low_mean": s["clip_low"] / tokens,
               "clip_ratio/high_mean": s["clip_high"] / tokens,
               "clip_ratio/region_mean": (s["clip_low"] + s["clip_high"]) / tokens}
    if "kl" in s:
        metrics["kl"] = s["kl"] / tokens
    return metrics

def check_dataset(dataset, name):  # A datasets.Dataset, with prompts to sample.
    ok = "prompt" in (getattr(dataset, "column_names", None) or ()) and len(dataset) > 0  # A list has none.
    require(ok, f"{name} must be a datasets.Dataset with rows and a 'prompt' column")
    return dataset

def call_reward(f, kwargs):  # f's rewards as a float32 column, NaN for None: one per completion.
    values = [math.nan if v is None else float(v) for v in f(**kwargs)]
    n = len(kwargs["completions"])
    name = getattr(f, "__name__", repr(f))
    require(not any(map(math.isinf, values)), f"reward function {name!r} returned an infinite reward")
    require(len(values) == n, f"reward function {name!r} returned {len(values)} values for {n} completions")
    return torch.tensor(values, dtype=torch.float32)

def load_policy(model, processing_class, peft_config, args, device):
    if isinstance(model, (str, os.PathLike)):  # Its folder's own Python is never run (trust_remote_code).
        model = AutoModelForCausalLM.from_pretrained(os.fspath(model), dtype=torch.float32)
    if peft_config is not None:
        torch.manual_seed(args.seed)  # The adapter's initial weights follow args.seed, as in HF's Trainer.
        model = importlib.import_module("peft").get_peft_model(model, peft_config)
    # Eval mode: no dropout, so π_old = π_θ exactly (nor HF's gradient checkpointing, a train-mode thing).
    model = model.to(device).eval()
    tokenizer = processing_class
    if tokenizer is None:  # The model's own, from its folder or the hub.
        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    require(tokenizer.eos_token_id is not None, "the tokenizer has no eos_token: completions could not end")
    if tokenizer.pad_token_id is None:  # Padding is masked out, so any id serves; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer

def is_peft(model):  # A peft.PeftModel (peft is imported by whoever made it): its adapter trains and saves.
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)

def reference_model(model):  # π_ref: a frozen copy of the policy, or the LoRA model (its adapter off).
    return model if is_peft(model) else copy.deepcopy(model).eval().requires_grad_(False)

def reference_weights(ref_model):  # With LoRA, π_ref is the base model: the adapter is off meanwhile.
    return ref_model.disable_adapter() if is_peft(ref_model) else contextlib.nullcontext()

def eos_token_ids(model, tokenizer):  # As in TRL: any of the tokenizer's and generation_config's EOS ids.
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else ids
    return torch.tensor(sorted({tokenizer.eos_token_id, *(ids or [])}), device=model.device)
