"""GRPO with multi-step (μ) optimization, in one file: the idea of TRL PR #2899, "6x faster GRPO with
multi-step optimization", written from scratch to be read.

GRPO (DeepSeekMath's Algorithm 1) trains a language model on rewards. For each prompt q it samples a group
of G completions o_1..o_G from the current policy π_old, scores them, and gives every token of o_i the
advantage A_i = (r_i - mean(r)) / (std(r) + 1e-4), with the mean and std taken over the group.

The multi-step trick reuses one batch of generations for μ = num_iterations optimizer steps. After the first
step the policy π_θ is no longer π_old, so each token's term is weighed by the importance ratio
ρ_t = π_θ(o_t) / π_old(o_t), with π_old's log-probs computed once and cached, and clipped as in PPO:

    loss_t = -min(ρ_t · A, clip(ρ_t, 1 - ε, 1 + ε_high) · A) + β · KL_t(π_θ ‖ π_ref)

With μ·S = 1, π_θ is π_old: its log-probs are the current ones, detached, and the gradient is exactly the
plain policy gradient (section 4 says why). A generation batch may also hold S optimizer steps' worth of
completions (TRL's steps_per_generation): each of its S mini-batches is used μ times, μ·S steps in all.

Part I is the algorithm, in the order of Algorithm 1. Part II is the engineering it calls: the config, a
faster log-prob pass, torchrun, metrics, checkpoints and input checks. Left out on purpose: vLLM (a plain loop
samples what the log-probs describe), DeepSpeed and FSDP, warmup, and Algorithm 1's resets of π_ref to π_θ.
"""
import copy, functools, importlib.util, json, math, os, random, shutil, signal, sys, threading, time, warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import numpy, safetensors.torch, torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

# ========================================= PART I: THE ALGORITHM =========================================
# ---- 1. Generation: for each prompt q, sample G completions o_1..o_G ~ π_old(· | q) --------------------
def tokenize_prompts(tokenizer, prompts, max_prompt_length):
    """Texts get the tokenizer's special tokens (a BOS), as in TRL; conversations the chat template's. Each
    keeps its last max_prompt_length tokens, padded on the left: every completion starts in one column."""
    chat = not isinstance(prompts[0], str)
    if chat:
        prompts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
    ids = check_prompt_ids(tokenizer(prompts, add_special_tokens=not chat)["input_ids"], max_prompt_length)
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
    or top-p: section 3's log-probs describe exactly what sampled), each ending at its first EOS. Returns
    the prompts repeated G times (B·G, P), their mask, the completions (B·G, C) and completion_mask."""
    G = args.num_generations
    eos = torch.as_tensor(eos_token_ids, device=prompt_ids.device)
    positions = position_ids(prompt_mask)                                                  # (B, P)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    out.cache.batch_repeat_interleave(G)  # Each prompt runs once; its G completions share its KV cache.
    logits = out.logits[:, -1].repeat_interleave(G, 0)                                     # (B·G, V)
    mask = prompt_mask.repeat_interleave(G, 0)                                             # (B·G, P)
    position = positions[:, -1:].repeat_interleave(G, 0)                                  # (B·G, 1)
    done = torch.zeros(len(mask), dtype=torch.bool, device=mask.device)                   # (B·G,)
    tokens = []
    for t in range(args.max_completion_length):
        token = sample_token(logits, args.temperature).masked_fill(done, tokenizer.pad_token_id)
        tokens.append(token)
        done = done | torch.isin(token, eos)
        if t % DONE_CHECK[token.device.type] == 0 and done.all():  # (A GPU waits for the host to know.)
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
    check_scored(rewards_per_func, completions)  # Each completion needs a reward from some function.
    return rewards_per_func                                                                # (N, F)

def group_advantages(rewards, num_generations, scale_rewards="group"):
    """A_i = (r_i - mean(r)) / (std(r) + 1e-4) within each group, with the unbiased (G - 1) std as in TRL.
    scale_rewards='none' (Dr. GRPO) leaves out the division. A prompt's G completions are adjacent rows."""
    grouped = rewards.view(-1, num_generations)                                            # (B, G)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale_rewards not in ("group", "none"):  # A misspelt name would silently mean no scaling.
        raise ValueError(f"scale_rewards={scale_rewards!r} must be 'group' or 'none'")
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
    # A group of equal rewards carries no signal: exactly 0, which a float mean of equal numbers can miss.
    all_equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    return advantages.masked_fill(all_equal, 0.0).view(-1)                                 # (B·G,)

# ---- 3. Per-token log-probs log π(o_t | q, o_<t), and the batch cut for the optimizer steps ------------
def plain_per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """log π(o_t | q, o_<t) by its definition: one pass over prompt and completion, where the state before
    each completion token predicts it, log_softmax(lm_head(h) / T) at that token (T: the sampling's).
    Training calls per_token_logps (Part II), the same faster, as a test checks."""
    mask = torch.cat([prompt_mask, completion_mask], 1)                                    # (b, P+C)
    hidden = model.get_decoder()(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                                 position_ids=position_ids(mask)).last_hidden_state       # (b, P+C, H)
    before_each_token = hidden[:, prompt_ids.size(1) - 1:-1]                               # (b, C, H)
    logits = model.get_output_embeddings()(before_each_token).float() / temperature       # (b, C, V)
    return logits.log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)       # (b, C)

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
    epsilon and beta (other fields default as in TRL). num_seqs and num_tokens count one optimizer step's
    completions and tokens over its micro-batches and processes: the micro-batches' losses add up."""
    epsilon_low = args.epsilon
    epsilon_high = getattr(args, "epsilon_high", None) or epsilon_low     # None: the same as epsilon
    A = advantages[:, None]                                                # (b, 1): one A per completion
    log_ratio = logps - old_logps                                          # log ρ_t = log π_θ - log π_old
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        # GSPO: one ratio per completion, the geometric mean of its tokens' ratios.
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
        if getattr(args, "use_bias_correction_kl", False):  # Its estimate under π_θ rather than π_old.
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + args.beta * per_token_kl
    # How the tokens' terms average into the loss. DAPO and Dr. GRPO are papers that changed GRPO's way.
    loss_type = getattr(args, "loss_type", "grpo")
    if loss_type == "grpo":  # GRPO's: the mean over each completion's tokens, then over completions.
        loss = ((per_token_loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_seqs
    elif loss_type == "bnpo":  # TRL PR #2899's: each micro-batch's token mean, weighed by its share.
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1) * len(mask) / num_seqs
    elif loss_type == "dapo":  # DAPO's: the step's token sum over its tokens (S > 1: their mean per step).
        loss = (per_token_loss * mask).sum() / num_tokens
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
class GRPOTrainer:
    """GRPOTrainer(model, reward_funcs, args, train_dataset).train(), as in TRL. model: a hub id, a folder
    or a causal LM (peft_config: a LoRA adapter trains on it). reward_funcs: f(prompts, completions,
    **kwargs) -> a number or None per completion, or a list. train_dataset: a "prompt" column, and others."""

    def __init__(self, model, reward_funcs, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None):
        check_versions()
        self.args = args if args is not None else GRPOConfig()
        self.rank, self.world_size, self.device = init_distributed()  # torchrun, or one process
        self.reward_funcs = check_reward_funcs(reward_funcs, self.args)
        self.train_dataset = check_dataset(train_dataset, "train_dataset")
        self.eval_dataset = check_dataset(eval_dataset, "eval_dataset", optional=True)
        self.model, self.tokenizer = load_policy(model, processing_class, peft_config, self.args, self.device)
        self.eos_token_ids = eos_token_ids(self.model, self.tokenizer)  # The tokenizer's and the model's.
        self.ref_model = reference_model(self.model, self.args.beta)  # π_ref, where β > 0 needs it.
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=self.args.learning_rate,
                                           weight_decay=self.args.weight_decay, fused=True)
        new_run(self)  # Step 0, no cached generation batch, the schedule (Part II).

    def train(self, resume_from_checkpoint=None):
        """Algorithm 1. A generation batch is sampled, scored and cached once, then its S mini-batches are
        used μ times each, one optimizer step per mini-batch: μ·S optimizer steps per generation batch."""
        start_run(self, resume_from_checkpoint)  # A fresh start or a resume (Part II).
        S = mini_batches_per_generation(self.args)
        steps_per_batch = self.args.num_iterations * S
        with keep_finished_steps(self):  # An error, Ctrl-C or SIGTERM checkpoints the last finished step.
            while self.step < self.args.max_steps and not self.should_stop:
                metrics = {}
                if self.step % steps_per_batch == 0:  # Time for a new generation batch: sections 1 to 3.
                    self.batch, metrics = self.generate_and_score(self.step // steps_per_batch)
                j = self.step % steps_per_batch  # This step is pass j // S of μ, on mini-batch j % S.
                metrics.update(self.optimizer_step(mini_batches(self.batch, S)[j % S]))
                end_of_step(self, metrics)  # Evaluate, log and checkpoint, as the config asks (Part II).
            save_final_model(self)
        return self

    def generate_and_score(self, k):
        """Sections 1 to 3 for generation batch k: sample and score completions, compute the advantages,
        and cache the log-probs that its μ·S optimizer steps need."""
        args = self.args
        S = mini_batches_per_generation(args)
        seed_random_generators(self, "train", k)  # Its draws depend on k alone, so a resume repeats them.
        lap(self, "generate")
        sample = self.sample_and_score(self.train_dataset, prompt_rows(self, k))
        advantages = group_advantages(sample["rewards"], args.num_generations, args.scale_rewards)
        mask = sample["completion_mask"]
        if args.mask_truncated_completions:  # DAPO's overlong filtering: completions cut short get no loss.
            mask = mask * ~sample["truncated"][:, None]
        # The loss's normalizers: one step's completions and tokens over all processes (S steps: ÷ S).
        num_seqs = all_reduce(self, torch.tensor(float(len(mask)), device=self.device)) / S
        num_tokens = all_reduce(self, mask.sum().float()) / S
        batch = {"prompt_ids": sample["prompt_ids"], "prompt_mask": sample["prompt_mask"],
                 "completion_ids": sample["completion_ids"], "completion_mask": mask,
                 "advantages": advantages.to(self.device), "num_seqs": num_seqs, "num_tokens": num_tokens}
        # 3. Log-probs, cached once per generation batch. π_old's are needed only if some step is not the
        # batch's first: with μ·S = 1 the training pass's own log-probs, detached, are π_old's.
        lap(self, "logps")
        if args.num_iterations * S > 1:
            batch["old_logps"] = self.cached_logps(self.model, batch)
        if args.beta > 0:
            with reference_weights(self.ref_model):  # With LoRA, π_ref is the model with its adapter off.
                batch["ref_logps"] = self.cached_logps(self.ref_model, batch)
        lap(self, None)
        self.samples = list(zip(sample["prompts"], sample["texts"], sample["rewards"].tolist()))
        return batch, batch_metrics(self, sample)

    def sample_and_score(self, dataset, indices):
        """Sections 1 and 2 for the prompts dataset[indices]: training's, or evaluate()'s held-out ones."""
        G = self.args.num_generations
        columns = dataset.select(indices).to_dict()                                       # {name: values}
        prompts = columns.pop("prompt")
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompts, self.args.max_prompt_length)
        with autocast(self):
            prompt_ids, prompt_mask, completion_ids, mask = generate_completions(
                self.model, self.tokenizer, prompt_ids.to(self.device), prompt_mask.to(self.device),
                self.args, self.eos_token_ids)
        lengths = mask.sum(1)                                                              # (N,)
        ids = [row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())]       # to the 1st EOS
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        completions = texts
        if not isinstance(prompts[0], str):  # A conversation's completion is an assistant message.
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        prompts = [p for p in prompts for _ in range(G)]  # Each prompt beside each of its completions.
        columns = {name: [v for v in values for _ in range(G)] for name, values in columns.items()}
        rewards_per_func = on_every_process(self, score_completions, self.reward_funcs, prompts, completions,
                                            ids, columns)                                  # (N, F)
        weights = torch.tensor(self.args.reward_weights or [1.0] * len(self.reward_funcs))  # (F,)
        return {"prompts": prompts, "texts": texts, "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                "completion_ids": completion_ids, "completion_mask": mask, "lengths": lengths,
                "rewards_per_func": rewards_per_func,
                "rewards": (rewards_per_func * weights).nansum(1),                  # r_i = Σ_f w_f r_if
                "truncated": ~torch.isin(completion_ids, self.eos_token_ids).any(1)}  # no EOS: cut short

    @torch.no_grad()
    def cached_logps(self, model, batch):
        """π_old's or π_ref's log-probs, in training's micro-batches: a batch's first ratio is exactly 1."""
        width = batch["completion_ids"].size(1)
        parts = []
        for mb in micro_batches(batch, self.args.per_device_train_batch_size):
            inputs = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
            with autocast(self):
                logps, _ = per_token_logps(model, *inputs, self.args.temperature)           # (b, c)
            parts.append(F.pad(logps, (0, width - logps.size(1))))  # Zeros pad back to C (masked out).
        return torch.cat(parts)                                                             # (N, C)

    def optimizer_step(self, batch):
        """One optimizer step on a mini-batch: forward passes, the clipped loss, backward, then AdamW."""
        args = self.args
        sums = defaultdict(float)
        for mb in micro_batches(batch, args.per_device_train_batch_size):  # Gradient accumulation.
            lap(self, "forward")
            inputs = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["completion_mask"])
            with autocast(self):
                logps, entropy = per_token_logps(self.model, *inputs, args.temperature)    # (b, c) each
            old_logps = mb.get("old_logps")  # π_old: cached, or with μ·S = 1 the current log-probs.
            if old_logps is None:
                old_logps = logps.detach()
            loss, stats = grpo_loss(logps, old_logps, mb.get("ref_logps"), mb["advantages"],
                                    mb["completion_mask"], args, batch["num_seqs"], batch["num_tokens"])
            lap(self, "backward")
            loss.backward()
            stats.update(loss=loss.detach(), tokens=mb["completion_mask"].sum(),
                         entropy=(entropy * mb["completion_mask"]).sum())  # The policy's, for a metric.
            for k, v in stats.items():
                sums[k] = sums[k] + v  # Tensors: no GPU sync per micro-batch.
        lap(self, "optimizer")
        all_reduce_gradients(self)  # Under torchrun, every process now holds the sum of all gradients.
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.max_grad_norm or math.inf)
        check_finite(self, grad_norm)  # Stops before a NaN reaches the weights.
        metrics = step_metrics(self, sums, grad_norm)
        with one_whole_update(self):  # A signal from now on waits for the step's end, its log and checkpoint.
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
        lap(self, None)
        return metrics

    def evaluate(self):  # The held-out reward (Part II).
        return evaluate(self)

    def log(self, metrics):  # Override to hook in; report_to's trackers get each row apart from this.
        write_metrics(self, metrics)  # Rank 0 prints the row and appends it to output_dir/metrics.jsonl.

# ======================================= PART II: THE ENGINEERING =======================================
# The config, with TRL's names; docs/reference.md lists each default beside TRL 1.16's.
def arg(default, help):  # A field with its --help text: train_tldr.py turns every field into a flag.
    return field(default=default, metadata={"help": help})

@dataclass
class GRPOConfig:
    """A process's optimizer step uses per_device_train_batch_size × gradient_accumulation_steps completions,
    num_generations per prompt. A generation batch holds steps_per_generation micro-batches: that is
    S = steps_per_generation / gradient_accumulation_steps optimizer steps' worth, each used μ times."""
    output_dir: str = arg("grpo-output", "Where metrics, checkpoints and the final model go.")
    overwrite_output_dir: bool = arg(False, "Start a fresh run in an output_dir that holds files.")
    learning_rate: float = arg(1e-6, "AdamW learning rate.")
    weight_decay: float = arg(0.0, "AdamW weight decay.")
    lr_scheduler_type: str = arg("linear", "'linear' (decay to 0 at max_steps) or 'constant'.")
    max_grad_norm: float = arg(1.0, "Gradient clipping norm (0: no clipping).")
    max_steps: int = arg(100, "Number of optimizer steps.")
    per_device_train_batch_size: int = arg(8, "Completions per forward and backward pass (micro-batch).")
    gradient_accumulation_steps: int = arg(1, "Micro-batches per optimizer step.")
    seed: int = arg(42, "Seed of the prompt order and of the sampling.")
    num_generations: int = arg(8, "G: completions sampled per prompt (the group).")
    max_prompt_length: int | None = arg(512, "Prompts keep their last this many tokens (None: all).")
    max_completion_length: int = arg(256, "Most tokens generated per completion.")
    temperature: float = arg(1.0, "Sampling temperature; the log-probs use the same one.")
    num_iterations: int = arg(1, "μ: optimizer steps on each mini-batch of a generation batch.")
    steps_per_generation: int | None = arg(None, "Micro-batches per generation batch (None: one step's).")
    epsilon: float = arg(0.2, "Lower clipping range: the ratio is kept >= 1 - epsilon.")
    epsilon_high: float | None = arg(None, "Upper clipping range: ratio <= 1 + epsilon_high (None: epsilon).")
    beta: float = arg(0.0, "KL coefficient; 0 loads no reference model at all.")
    use_bias_correction_kl: bool = arg(False, "Weigh the KL term by the ratio ρ (TRL 1.16's default: True).")
    loss_type: str = arg("grpo", "'grpo', 'bnpo' (TRL PR #2899's), 'dapo' or 'dr_grpo': how tokens average.")
    importance_sampling_level: str = arg("token", "One ratio per 'token', or per 'sequence' (GSPO).")
    mask_truncated_completions: bool = arg(False, "No loss on completions cut at max_completion_length.")
    scale_rewards: str = arg("group", "'group': divide advantages by the group's reward std; 'none': don't.")
    reward_weights: list[float] | None = arg(None, "One weight per reward function (None: all 1).")
    model_init_kwargs: dict | str | None = arg(None, "from_pretrained's keyword arguments (JSON too).")
    bf16: bool = arg(False, "bfloat16 autocast for every model call (fast on GPUs, slow on most CPUs).")
    gradient_checkpointing: bool = arg(False, "Recompute activations in backward: less memory, more time.")
    logging_steps: int = arg(10, "Log averaged metrics every this many optimizer steps.")
    log_completions: bool = arg(False, "Print a few prompts, completions and rewards at each log.")
    report_to: list[str] | str = arg("none", "Trackers: 'tensorboard', 'wandb', 'trackio', a list, 'all'.")
    eval_strategy: str = arg("no", "'steps': sample and score eval_dataset every eval_steps; 'no': never.")
    eval_steps: int | None = arg(None, "Optimizer steps between evaluations (None: logging_steps).")
    save_steps: int = arg(500, "Write a checkpoint every this many optimizer steps.")
    save_total_limit: int | None = arg(None, "Keep at most this many checkpoints (None: all).")

    def __post_init__(self):
        check_config(self)

# per_token_logps: plain_per_token_logps made fast (a test holds them equal). A prompt's G completions share
# one pass over it, and the LM head runs CHUNK tokens at a time: no (b, C, V) logits at once. It also
# returns each token's entropy H(π(· | q, o_<t)), from the same logits, for a metric. (b, C) each.
def per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    mask = torch.cat([prompt_mask, completion_mask], 1)                                    # (b, P+C)
    decoder = model.get_decoder()
    P = prompt_ids.size(1)
    positions = position_ids(mask)                                                         # (b, P+C)
    if model.is_activation_checkpointing:  # Recomputed layers cannot share a prompt's cache: one pass.
        hidden = decoder(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                         position_ids=positions).last_hidden_state[:, P - 1:-1]            # (b, C, H)
    else:  # B·P + B·G·C tokens, not B·G·(P + C): G completions attend to one pass over their prompt.
        first = torch.ones(len(prompt_ids), dtype=torch.bool, device=mask.device)  # A prompt's first row.
        first[1:] = ((prompt_ids[1:] != prompt_ids[:-1]) | (prompt_mask[1:] != prompt_mask[:-1])).any(1)
        prompt_of = first.cumsum(0) - 1                                                    # (b,)
        prompt = decoder(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                         position_ids=positions[first, :P], use_cache=True)
        prompt.cache.batch_select_indices(prompt_of)  # Each row gets its prompt's keys and values.
        completion = decoder(input_ids=completion_ids, attention_mask=mask, position_ids=positions[:, P:],
                             cache=prompt.cache, use_cache=True).last_hidden_state        # (b, C, H)
        # The prompt's last state predicts completion token 0; completion token t's state predicts t + 1.
        hidden = torch.cat([prompt.last_hidden_state[prompt_of, -1:], completion[:, :-1]], 1)  # (b, C, H)
    head = model.get_output_embeddings()  # logits = lm_head(hidden), as load_policy checks.
    pairs = zip(hidden.flatten(0, 1).split(CHUNK), completion_ids.flatten().split(CHUNK))
    results = [TokenLogps.apply(h, y, temperature, head.weight, head.bias) for h, y in pairs]
    logps = torch.cat([r[0] for r in results]).view_as(completion_ids)
    entropies = torch.cat([r[1] for r in results]).view_as(completion_ids)
    return logps, entropies

CHUNK = 256  # Tokens per LM-head chunk: 256 × 49,152 logits are 50 MB for SmolLM2.
DONE_CHECK = defaultdict(lambda: 8, cpu=1)  # Decoding steps between "have all ended?" checks.

# The LM head for CHUNK tokens: log π(y) = z_y - logsumexp(z), z = (h Wᵀ + b) / T. Forward keeps only h and
# logsumexp(z); backward computes z again, in place, into the gradient onehot(y) - softmax(z). Against
# activation checkpointing of the head this saves 0.27 GiB and 5 % of the time (SmolLM2, the CPU demo).
class TokenLogps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, targets, temperature, weight, bias):                 # (n, H), (n,)
        logits = F.linear(hidden, weight, bias).float().div_(temperature)                  # (n, V): z
        lse = logits.logsumexp(-1)                                                         # (n,)
        ctx.save_for_backward(hidden, targets, weight, bias, lse)
        ctx.temperature = temperature
        ctx.bf16 = torch.is_autocast_enabled(hidden.device.type)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse                       # (n,)
        log_probs = logits.sub_(lse[:, None])                           # (n, V): log π(v), in z's memory
        entropy = -log_probs.exp().mul_(log_probs).sum(-1)              # (n,): -Σ_v π(v) log π(v)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _):                                          # grad (n,): d loss / d log π(y)
        hidden, targets, weight, bias, lse = ctx.saved_tensors
        with torch.autocast(hidden.device.type, torch.bfloat16, enabled=ctx.bf16):  # As in forward.
            logits = F.linear(hidden, weight, bias).float()                                # (n, V)
        grad_z = logits.div_(ctx.temperature).sub_(lse[:, None]).exp_().mul_(-grad[:, None])  # -softmax·grad
        grad_z.scatter_add_(1, targets[:, None], grad[:, None])                            # + onehot(y)·grad
        grad_logits = grad_z.div_(ctx.temperature).to(weight.dtype)                        # dz/dlogits = 1/T
        grad_weight = None
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_weight = grad_logits.T @ hidden.to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[4]:
            grad_bias = grad_logits.sum(0)
        return (grad_logits @ weight).to(hidden.dtype), None, None, grad_weight, grad_bias

# The data order: generation batch k's prompts are a function of k alone, so that a resume picks the same.
# A process takes its share of each of the batch's S steps, so any number of processes make the same steps.
def prompt_rows(trainer, k):
    args = trainer.args
    n = len(trainer.train_dataset)
    S = mini_batches_per_generation(args)
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    indices = []
    for j in range(S):
        first = ((k * S + j) * trainer.world_size + trainer.rank) * per_step
        for i in range(first, first + per_step):
            indices.append(epoch_order(n, args.seed + i // n)[i % n])  # One shuffle of the rows per epoch.
    return indices

@functools.lru_cache(maxsize=2)
def epoch_order(n, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()

# Random draws seeded per generation batch and process, from the config's seed: nothing random to save.
def seed_random_generators(trainer, purpose, k):
    entropy = [trainer.args.seed, ("train", "eval").index(purpose), k, trainer.rank]
    seed = int(numpy.random.SeedSequence(entropy).generate_state(1)[0])
    random.seed(seed)
    numpy.random.seed(seed)  # For reward functions that draw from numpy.
    torch.manual_seed(seed)

# Seconds per phase, logged as time_<phase>; a GPU is synchronized at each boundary, to be measured.
PHASES = ("generate", "logps", "forward", "backward", "optimizer")

def lap(trainer, phase):  # Ends the running phase and starts `phase` (None: time that no phase counts).
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    now = time.perf_counter()
    trainer.seconds[trainer.phase] += now - trainer.phase_start
    trainer.phase = phase
    trainer.phase_start = now

def autocast(trainer):  # bf16: the model calls run in bfloat16; the loss and AdamW stay in float32.
    return torch.autocast(trainer.device.type, dtype=torch.bfloat16, enabled=trainer.args.bf16)

# torchrun: every process runs this program on its own prompts and divides its loss by the whole step's
# normalizers, so that the sum of the processes' gradients is the step's. (DDP's hooks would miss the LM
# head, which per_token_logps calls directly.)
def init_distributed():
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)  # Before any collective: NCCL uses the current device.
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    return 0, 1, device

def all_reduce(trainer, x):  # The sum over the processes (one process: x itself).
    if trainer.world_size > 1:
        dist.all_reduce(x)
    return x

def all_reduce_gradients(trainer):  # One flat buffer, one collective.
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    if trainer.world_size > 1 and grads:
        flat = all_reduce(trainer, torch.cat([g.flatten() for g in grads]))
        torch.nn.utils.vector_to_parameters(flat, grads)

def on_every_process(trainer, fn, *args):  # User code: an error in one process is raised in all of them,
    error = None                            # so that none waits forever for the others in a collective.
    try:
        result = fn(*args)
    except Exception as e:
        error = e
    failed = all_reduce(trainer, torch.tensor(float(error is not None), device=trainer.device))
    if error is not None:
        raise error
    require(failed == 0, "a reward function failed in another process (see its log)", RuntimeError)
    return result

# Metrics, with TRL's names; means over the processes, in one all-reduce.
def batch_metrics(trainer, sample):
    grouped = sample["rewards"].view(-1, trainer.args.num_generations)                      # (B, G)
    flat = grouped.max(1).values == grouped.min(1).values  # Groups with no signal (section 2).
    metrics = {"reward": grouped.mean(), "reward_std": grouped.std(1).mean(),
               "frac_reward_zero_std": flat.float().mean(),
               "completions/mean_length": sample["lengths"].float().mean(),
               "completions/clipped_ratio": sample["truncated"].float().mean()}
    names = [getattr(f, "__name__", type(f).__name__) for f in trainer.reward_funcs]
    for i, name in enumerate(names):
        if names.count(name) > 1:  # Two functions of one name (two lambdas) keep a metric each.
            name = f"{name}_{names[:i].count(name) + 1}"
        metrics[f"rewards/{name}/mean"] = sample["rewards_per_func"][:, i].nanmean()
    values = torch.stack([v.float().to(trainer.device) for v in metrics.values()])
    return dict(zip(metrics, (all_reduce(trainer, values) / trainer.world_size).tolist()))

def step_metrics(trainer, sums, grad_norm):  # Sums over micro-batches and processes, per loss token.
    s = dict(zip(sums, all_reduce(trainer, torch.stack([v.float() for v in sums.values()])).tolist()))
    tokens = max(s["tokens"], 1.0)  # 0 where every completion was masked.
    metrics = {"loss": s["loss"], "grad_norm": float(grad_norm),
               "learning_rate": trainer.scheduler.get_last_lr()[0], "entropy": s["entropy"] / tokens,
               "clip_ratio/low_mean": s["clip_low"] / tokens, "clip_ratio/high_mean": s["clip_high"] / tokens,
               "clip_ratio/region_mean": (s["clip_low"] + s["clip_high"]) / tokens}
    if "kl" in s:
        metrics["kl"] = s["kl"] / tokens
    return metrics

def check_finite(trainer, grad_norm):  # A NaN or inf gradient would spread to every weight.
    if not torch.isfinite(grad_norm):
        trainer.optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"step {trainer.step + 1}: the gradient norm is {float(grad_norm)}; the "
                                 "weights are left as they were (check the rewards, the learning rate, bf16)")

def evaluate(trainer):
    """The held-out reward: eval_dataset's prompts (this process's share) sampled and scored as in training,
    a generation batch's worth at a time, seeded alike at every evaluation. The next generation batch seeds
    itself anew, so a run with evaluations makes the same updates as one without."""
    start = time.perf_counter()
    seed_random_generators(trainer, "eval", 0)
    prompts = list(range(trainer.rank, len(trainer.eval_dataset), trainer.world_size))
    size = len(prompt_rows(trainer, 0))
    samples = [trainer.sample_and_score(trainer.eval_dataset, prompts[i:i + size])
               for i in range(0, len(prompts), size)]
    sample = {k: torch.cat([s[k] for s in samples]) for k in ("rewards", "rewards_per_func", "lengths",
                                                              "truncated")}
    metrics = {f"eval_{k}": v for k, v in batch_metrics(trainer, sample).items()}
    metrics["time_eval"] = time.perf_counter() - start
    return metrics

# After each step: evaluate, log and checkpoint, in that order as in TRL; then stop where log() asked to.
def end_of_step(trainer, metrics):
    args = trainer.args
    for phase in PHASES:
        metrics[f"time_{phase}"] = trainer.seconds.pop(phase, 0.0)
    if args.eval_strategy == "steps" and trainer.step % (args.eval_steps or args.logging_steps) == 0:
        metrics.update(trainer.evaluate())
    for k, v in metrics.items():
        trainer.window[k].append(v)
    if trainer.step % args.logging_steps == 0 or trainer.step == args.max_steps:
        row = {"step": trainer.step}
        for k, values in trainer.window.items():
            row[k] = sum(values) / len(values)
        row["elapsed"] = time.perf_counter() - trainer.start_time
        trainer.window.clear()
        trainer.log(row)
        for tracker in trainer.trackers:
            tracker.log(row)
    if trainer.step % args.save_steps == 0:
        save_checkpoint(trainer)
    stop = all_reduce(trainer, torch.tensor(float(trainer.should_stop), device=trainer.device))
    trainer.should_stop = bool(stop > 0)  # Every process stops at the same step.
    trainer.hold_signals = False
    if trainer.signal is not None:  # It came during this step's update, log or checkpoint: all done now.
        raise exception_for(trainer.signal)

def write_metrics(trainer, metrics):
    if trainer.rank != 0:
        return
    row = {}  # JSON has no NaN: null, as where a reward function never applied.
    for k, v in metrics.items():
        row[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    with open(os.path.join(trainer.args.output_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    print(" | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()))
    if not trainer.args.log_completions:
        return
    for prompt, completion, reward in trainer.samples[:4]:
        if not isinstance(prompt, str):  # A conversation: its last message.
            prompt = prompt[-1]["content"]
        print(f"  [reward {reward:+.3f}] {prompt[-60:]!r} -> {completion[:100]!r}")

# report_to: a tracker is imported only where it is named; it gets every row, on rank 0, at its step.
TRACKERS = ("tensorboard", "wandb", "trackio")

class Tracker:
    def __init__(self, name, args):
        self.name = name
        if name == "tensorboard":  # Event files in output_dir/runs/<date-time>, where TRL writes them.
            folder = os.path.join(args.output_dir, "runs", time.strftime("%Y%m%d-%H%M%S"))
            self.run = importlib.import_module("torch.utils.tensorboard").SummaryWriter(folder)
        else:  # wandb and trackio share an API: init(project=, config=) returns a run.
            project = os.environ.get(f"{name.upper()}_PROJECT", "huggingface")  # As transformers does.
            self.run = importlib.import_module(name).init(project=project, config=asdict(args))

    def log(self, row):
        metrics = {k: v for k, v in row.items() if k != "step"}
        if self.name == "tensorboard":
            for k, v in metrics.items():
                self.run.add_scalar(k, v, row["step"])
        else:
            self.run.log(metrics, step=row["step"])

    def close(self):
        if self.name == "tensorboard":
            self.run.close()
        else:
            self.run.finish()

# The state of a run: a fresh one, or from a checkpoint.
def new_run(trainer):
    trainer.step = 0
    trainer.batch = None  # The generation batch that the current μ·S optimizer steps share.
    trainer.samples = []
    trainer.should_stop = False  # log() may set it, to end training after this step.
    trainer.signal = None
    trainer.hold_signals = False  # True from a weight update to the end of its step, and in a failure's save.
    trainer.updating = False
    trainer.window = defaultdict(list)  # The metrics of the steps since the last logged row.
    trainer.seconds = defaultdict(float)
    trainer.phase = None
    trainer.start_time = time.perf_counter()
    trainer.phase_start = trainer.start_time
    trainer.trackers = []
    trainer.optimizer.zero_grad(set_to_none=True)
    lr_schedule(trainer, 0)

def lr_schedule(trainer, step):  # AdamW's learning rate from `step` on: a linear decay to 0, or constant.
    args = trainer.args
    for group in trainer.optimizer.param_groups:  # The config's values, also on a resume that changed them.
        group["initial_lr"] = args.learning_rate
        group["weight_decay"] = args.weight_decay
    factor = constant_factor
    if args.lr_scheduler_type == "linear":
        factor = functools.partial(linear_factor, args.max_steps)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, factor, last_epoch=step - 1)

def linear_factor(max_steps, step):  # As TRL's: the learning rate falls linearly to 0 at max_steps.
    return 1 - step / max_steps

def constant_factor(step):
    return 1.0

def start_run(trainer, resume_from_checkpoint):  # Checks, output_dir, then a fresh run or a resume.
    args = trainer.args
    check_config(args)  # Fields may have changed since the trainer was made.
    require(args.eval_strategy == "no" or trainer.eval_dataset is not None, "eval_strategy='steps' needs "
            "an eval_dataset")
    n = len(trainer.eval_dataset or [])  # Else the processes would run different numbers of collectives.
    require(n % trainer.world_size == 0, f"eval_dataset's {n} prompts do not split evenly over "
            f"{trainer.world_size} processes")
    require(args.beta == 0 or trainer.ref_model is not None, "beta was 0 when the trainer was made, so it "
            "has no reference model: make a new trainer")
    check_trainable(trainer.model)
    trainer.model.activation_checkpointing_disable()  # As the config says now.
    if args.gradient_checkpointing:
        trainer.model.activation_checkpointing_enable({"use_reentrant": False})
    os.makedirs(args.output_dir, exist_ok=True)
    if trainer.rank == 0:
        prepare_output_dir(args, resume_from_checkpoint)
    if trainer.world_size > 1:
        dist.barrier()  # The other processes write into output_dir only once it is ready.
    new_run(trainer)
    if resume_from_checkpoint:
        load_checkpoint(trainer, resume_from_checkpoint)
    if trainer.rank == 0:
        trainer.trackers = [Tracker(name, args) for name in args.report_to]

def prepare_output_dir(args, resume_from_checkpoint):
    """A fresh run never mixes its files with another run's: it refuses an output_dir that holds files,
    unless overwrite_output_dir, which deletes the earlier run's checkpoints and metrics (no other file)."""
    out = args.output_dir
    names = sorted(os.listdir(out))
    require(not names or resume_from_checkpoint or args.overwrite_output_dir, f"output_dir {out!r} holds "
            f"{', '.join(names[:5])}: choose another output_dir, resume the run there "
            "(resume_from_checkpoint=True), or set overwrite_output_dir=True")
    for name in names:
        path = os.path.join(out, name)
        if name.startswith("checkpoint-") and (name.endswith(".tmp") or not resume_from_checkpoint):
            shutil.rmtree(path)  # A resume picks among complete checkpoints; unfinished ones go.
        if name == "metrics.jsonl" and not resume_from_checkpoint:
            os.remove(path)

# A failure never loses finished steps: on any exception (Ctrl-C included) and at once on SIGTERM (sent at
# preemption; torchrun passes it to every process), a checkpoint of the last finished step is written, then
# the exception goes on. Only the main thread can catch signals: elsewhere SIGTERM ends the process at once.
@contextmanager
def keep_finished_steps(trainer):
    def on_signal(signum, frame):
        trainer.signal = signum
        if not trainer.hold_signals:  # Else what is being written ends first.
            raise exception_for(signum)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            previous[s] = signal.signal(s, on_signal)
    try:
        yield
    except BaseException:
        if trainer.step > 0 and not trainer.updating:  # (A failed update leaves no step to save whole.)
            trainer.hold_signals = True
            save_checkpoint(trainer)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for tracker in trainer.trackers:
            tracker.close()

@contextmanager
def one_whole_update(trainer):  # A signal from here waits for the end of the step: end_of_step raises it.
    trainer.hold_signals = True
    trainer.updating = True
    yield
    trainer.updating = False  # Not reached if the update fails: its weights are then not checkpointed.

def exception_for(signum):  # Ctrl-C is a KeyboardInterrupt; SIGTERM exits with 128 + 15, as shells say.
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)

# Checkpoints: checkpoint-<step> holds the model's (or the adapter's) safetensors, trainer_state.pt (step,
# AdamW, config) and a rank_<r>.pt per process, with its generation batch where the checkpoint falls inside
# one: the remaining steps of that batch reuse its completions and cached log-probs, so with μ·S > 1 they
# are training state as much as the weights are. Written to checkpoint-<step>.tmp, then renamed.
def save_checkpoint(trainer):
    args = trainer.args
    folder = os.path.join(args.output_dir, f"checkpoint-{trainer.step}")
    if os.path.isdir(folder):  # Written already: a failure right after a periodic save.
        return
    os.makedirs(folder + ".tmp", exist_ok=True)
    batch = None
    if trainer.step % (args.num_iterations * mini_batches_per_generation(args)) != 0:
        batch = {k: v.cpu() for k, v in trainer.batch.items()}
    rank_file = os.path.join(folder + ".tmp", f"rank_{trainer.rank}.pt")
    torch.save({"batch": batch}, rank_file + ".part")
    os.replace(rank_file + ".part", rank_file)  # Complete or absent: rank 0 waits for each below.
    if trainer.rank != 0:
        return
    trainer.model.save_pretrained(folder + ".tmp")
    state = {"step": trainer.step, "optimizer": trainer.optimizer.state_dict(), "config": asdict(args),
             "world_size": trainer.world_size, "window": dict(trainer.window),
             "elapsed": time.perf_counter() - trainer.start_time}
    torch.save(state, os.path.join(folder + ".tmp", "trainer_state.pt"))
    wait_for_files([os.path.join(folder + ".tmp", f"rank_{r}.pt") for r in range(trainer.world_size)])
    os.replace(folder + ".tmp", folder)
    if args.save_total_limit is not None:
        for old in list_checkpoints(args.output_dir)[:-args.save_total_limit]:
            shutil.rmtree(old)

def wait_for_files(paths, seconds=60):  # The other processes' files, without a collective (none may run).
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.1)
    missing = [p for p in paths if not os.path.exists(p)]
    require(not missing, f"{missing} not written in {seconds} s: the checkpoint is unfinished", RuntimeError)

def list_checkpoints(output_dir):  # The complete ones, oldest first.
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    found = []
    for name in names:
        number = name.removeprefix("checkpoint-")
        if name.startswith("checkpoint-") and number.isdecimal():  # (Not checkpoint-<step>.tmp.)
            found.append((int(number), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]

def load_checkpoint(trainer, path):
    """Tensors and plain values only (safetensors, torch.load with weights_only): no code runs. It checks
    that the checkpoint is this run's (the batch shape) and this model's (the weights' names and shapes)
    before anything is loaded."""
    args = trainer.args
    if path is True:  # The newest in output_dir.
        found = list_checkpoints(args.output_dir)
        require(found, f"{args.output_dir!r} holds no checkpoint to resume: start a fresh run")
        path = found[-1]
    require(os.path.isfile(os.path.join(path, "trainer_state.pt")), f"{path!r} is no checkpoint folder")
    state = torch.load(os.path.join(path, "trainer_state.pt"), map_location="cpu", weights_only=True)
    then = dict(state["config"], world_size=state["world_size"])
    now = dict(asdict(args), world_size=trainer.world_size)
    for config in (then, now):  # None means gradient_accumulation_steps.
        gas = config["gradient_accumulation_steps"]
        config["S"] = (config["steps_per_generation"] or gas) // gas
    shape = ("num_iterations", "S", "num_generations", "per_device_train_batch_size",
             "gradient_accumulation_steps", "world_size")  # What the prompt order and the batch depend on.
    changed = {k: (then[k], now[k]) for k in shape if then[k] != now[k]}
    require(not changed, f"checkpoint {path!r} was written with another batch shape (then, now): {changed}")
    peft = is_peft(trainer.model)
    file = os.path.join(path, "adapter_model.safetensors" if peft else "model.safetensors")
    require(os.path.isfile(file), f"{file} is missing: {path!r} holds {sorted(os.listdir(path))}, from a "
            "run of another kind (LoRA or not)")
    weights = safetensors.torch.load_file(file, device=str(trainer.device))
    if peft:
        ours = sys.modules["peft"].get_peft_model_state_dict(trainer.model)
    else:
        ours = trainer.model.state_dict()
    loaded = {ours[k].data_ptr() for k in weights if k in ours}
    tied = {k for k in ours if k not in weights and ours[k].data_ptr() in loaded}  # Saved once, as one.
    wrong = [k for k in set(weights) | (set(ours) - tied)
             if k not in weights or k not in ours or weights[k].shape != ours[k].shape]
    require(not wrong, f"{file} is another model's: {sorted(wrong)[:3]} differ in name or shape")
    if peft:
        sys.modules["peft"].set_peft_model_state_dict(trainer.model, weights)
    else:
        trainer.model.load_state_dict(weights, strict=False)  # All but the tied weights, checked above.
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.step = state["step"]
    lr_schedule(trainer, trainer.step)
    trainer.window = defaultdict(list, state["window"])
    trainer.start_time -= state["elapsed"]  # The clock goes on.
    rank_file = os.path.join(path, f"rank_{trainer.rank}.pt")
    trainer.batch = torch.load(rank_file, map_location=trainer.device, weights_only=True)["batch"]
    if trainer.rank == 0:
        keep_metrics_up_to(args.output_dir, trainer.step)

def keep_metrics_up_to(output_dir, step):  # The resumed run logs the later steps again: each step once.
    path = os.path.join(output_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows = [row for row in f if row.endswith("\n") and json.loads(row)["step"] <= step]
        with open(path + ".tmp", "w") as f:
            f.writelines(rows)
        os.replace(path + ".tmp", path)

def save_final_model(trainer):  # For from_pretrained(output_dir): the model, or the adapter, and tokenizer.
    if trainer.rank == 0:
        trainer.model.save_pretrained(trainer.args.output_dir)
        trainer.tokenizer.save_pretrained(trainer.args.output_dir)

# Input checks: a bad input that would give a silent wrong result, or an error deep inside torch, fails
# at the start with a message that names it.
def require(ok, message, error=ValueError):
    if not ok:
        raise error(message)

def check_config(c):
    if isinstance(c.report_to, str):  # TRL's: a name, a list of names, "all" or "none".
        c.report_to = [c.report_to]
    installed = [name for name in TRACKERS if importlib.util.find_spec(name) is not None]
    if c.report_to == ["all"]:
        c.report_to = installed
    if c.report_to == ["none"]:
        c.report_to = []
    at_least_1 = ("num_iterations max_steps per_device_train_batch_size gradient_accumulation_steps "
                  "max_completion_length logging_steps save_steps max_prompt_length save_total_limit "
                  "steps_per_generation eval_steps")
    for name in at_least_1.split():
        require(getattr(c, name) is None or getattr(c, name) >= 1, f"GRPOConfig.{name}={getattr(c, name)!r} "
                "must be >= 1")
    for name in ("beta", "learning_rate", "weight_decay", "max_grad_norm", "seed"):
        require(getattr(c, name) >= 0, f"GRPOConfig.{name}={getattr(c, name)!r} must be >= 0")
    require(c.temperature > 0, f"GRPOConfig.temperature={c.temperature!r} must be > 0")
    require(c.num_generations >= 2, f"GRPOConfig.num_generations={c.num_generations!r} must be >= 2: a group "
            "of one has no baseline")
    require(0 < c.epsilon < 1, f"GRPOConfig.epsilon={c.epsilon!r} must lie in (0, 1)")
    require(c.epsilon_high is None or c.epsilon_high > 0, f"GRPOConfig.epsilon_high={c.epsilon_high!r} "
            "must be > 0")
    choices = {"loss_type": ("grpo", "bnpo", "dapo", "dr_grpo"), "scale_rewards": ("group", "none"),
               "lr_scheduler_type": ("linear", "constant"), "eval_strategy": ("no", "steps"),
               "importance_sampling_level": ("token", "sequence"), "report_to": TRACKERS}
    for name, allowed in choices.items():
        values = c.report_to if name == "report_to" else [getattr(c, name)]
        require(all(v in allowed for v in values), f"GRPOConfig.{name}={getattr(c, name)!r} must be one of "
                f"{allowed}")
    missing = [name for name in c.report_to if name not in installed]
    require(not missing, f"GRPOConfig.report_to names {missing}, which are not installed: pip install "
            + " ".join(missing), ImportError)
    per_step = c.per_device_train_batch_size * c.gradient_accumulation_steps
    require(per_step % c.num_generations == 0, f"per_device_train_batch_size × gradient_accumulation_steps "
            f"= {per_step} is not divisible by num_generations={c.num_generations}: a group would be split")
    spg = c.steps_per_generation or c.gradient_accumulation_steps
    require(spg % c.gradient_accumulation_steps == 0, f"steps_per_generation={spg} is not a multiple of "
            f"gradient_accumulation_steps={c.gradient_accumulation_steps}: a generation batch is whole steps")

def check_reward_funcs(reward_funcs, args):
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    require(funcs and all(callable(f) for f in funcs), "reward_funcs must be a function or a non-empty list "
            f"of functions, got {reward_funcs!r}", TypeError)
    n = len(args.reward_weights or funcs)
    require(n == len(funcs), f"GRPOConfig.reward_weights has {n} weights for {len(funcs)} reward functions")
    return funcs

def check_dataset(dataset, name, optional=False):  # A datasets.Dataset, or a list of rows {"prompt": ...}.
    if dataset is None and optional:
        return None
    if isinstance(dataset, list):
        dataset = Dataset.from_list(dataset)
    require(isinstance(dataset, Dataset), f"{name} must be a datasets.Dataset (prompts are drawn by index, "
            f"so not streamed) or a list of rows {{'prompt': ...}}, got {type(dataset).__name__}", TypeError)
    require("prompt" in dataset.column_names and len(dataset) > 0, f"{name} must have rows and a 'prompt' "
            f"column ({len(dataset)} rows, columns {dataset.column_names})")
    return dataset

def check_prompt_ids(ids, max_prompt_length):
    if max_prompt_length is not None and max(len(x) for x in ids) > max_prompt_length:
        warnings.warn(f"prompts longer than max_prompt_length={max_prompt_length} tokens keep their last "
                      f"{max_prompt_length} tokens: their beginning is dropped", stacklevel=3)
        ids = [x[-max_prompt_length:] for x in ids]
    return ids

def call_reward(f, kwargs):  # f's rewards as a float32 column, NaN for None, or an error that names f.
    name = getattr(f, "__name__", repr(f))
    try:
        values = [math.nan if v is None else float(v) for v in f(**kwargs)]
    except Exception as e:
        raise RuntimeError(f"reward function {name!r} failed: {type(e).__name__}: {e}") from e
    n = len(kwargs["completions"])
    require(len(values) == n, f"reward function {name!r} returned {len(values)} values for {n} completions")
    return torch.tensor(values, dtype=torch.float32)

def check_scored(rewards_per_func, completions):  # Else the reward would silently be 0.
    unscored = rewards_per_func.isnan().all(1).nonzero()[:, 0].tolist()
    require(not unscored, f"every reward function returned None for completion {unscored[:1]}: at least one "
            "must score each completion")

def load_policy(model, processing_class, peft_config, args, device):  # Checked for what training assumes.
    if isinstance(model, (str, os.PathLike)):
        kwargs = args.model_init_kwargs or {}
        if isinstance(kwargs, str):  # JSON, from a command line.
            kwargs = json.loads(kwargs)
        kwargs = dict(kwargs)
        kwargs.setdefault("dtype", torch.float32)
        kwargs.setdefault("trust_remote_code", False)  # A folder's own Python runs only if asked for.
        model = AutoModelForCausalLM.from_pretrained(str(model), **kwargs)
    require(isinstance(model, PreTrainedModel) or is_peft(model), "model must be a hub id, a folder, a "
            f"PreTrainedModel or a peft.PeftModel, got {type(model).__name__}", TypeError)
    if peft_config is not None:
        with torch.random.fork_rng(devices=[]):  # The adapter's initial weights follow args.seed.
            torch.manual_seed(args.seed)
            model = importlib.import_module("peft").get_peft_model(model, peft_config)
    model = model.to(device).train()
    check_trainable(model)
    for m in model.modules():  # No dropout: the same weights must give the same log-probs (π_old = π_θ).
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    tokenizer = processing_class
    if tokenizer is None:  # The model's own, from its folder or the hub.
        tokenizer = AutoTokenizer.from_pretrained(model.config._name_or_path)
    require(tokenizer.eos_token_id is not None, "the tokenizer has no eos_token: completions could not end")
    if tokenizer.pad_token_id is None:  # Padding is masked out, so any id serves; EOS is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    with torch.no_grad():  # per_token_logps computes the logits as lm_head(hidden states).
        ids = torch.tensor([[tokenizer.eos_token_id] * 3], device=device)
        head = model.get_output_embeddings()
        logits = model(input_ids=ids).logits[:, -3:]
        head_logits = head(model.get_decoder()(input_ids=ids).last_hidden_state)
        same = isinstance(head, torch.nn.Linear) and torch.allclose(logits, head_logits, rtol=1e-3, atol=1e-3)
    require(same, f"{type(model).__name__}'s logits are not lm_head(hidden states) (softcapping, scaling, an "
            "adapter on lm_head?): the log-probs would be wrong")
    return model, tokenizer

def check_trainable(model):  # In 16 bits, AdamW's small updates would round away.
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
    require(dtypes == ["torch.float32"], f"{type(model).__name__}'s trainable weights are {dtypes}: train "
            "float32 weights (bf16=True computes in bfloat16), or a LoRA adapter")

def is_peft(model):  # A peft.PeftModel (peft is imported by whoever made it): its adapter trains and saves.
    return "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel)

def reference_model(model, beta):  # π_ref where β > 0: a frozen copy of the policy, or the LoRA model.
    if beta == 0:
        return None
    if is_peft(model):
        return model
    return copy.deepcopy(model).eval().requires_grad_(False)

def reference_weights(ref_model):  # With LoRA, π_ref is the base model: the adapter is off meanwhile.
    if is_peft(ref_model):
        return ref_model.disable_adapter()
    return nullcontext()

def eos_token_ids(model, tokenizer):  # As in TRL: any of the tokenizer's and generation_config's EOS ids.
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(ids, int):
        ids = [ids]
    ids = list(ids or [])
    return torch.tensor(sorted({tokenizer.eos_token_id, *ids}), device=model.device)

def check_versions():  # The requirements' lower bounds: older versions fail deep inside, unnamed.
    from packaging.version import Version
    for module, need in ((torch, "2.4"), (importlib.import_module("transformers"), "5.24")):
        found = module.__version__.split("+")[0]
        require(Version(found) >= Version(need), f"grpo_multistep's GRPOTrainer needs {module.__name__} >= "
                f"{need}, found {found}: pip install '{module.__name__}>={need}'", ImportError)
