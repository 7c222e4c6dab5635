"""TRL 1.16.0's GRPOTrainer as the oracle: its loss and gradients on fixed batches, written to golden.json.

tests/test_trl_parity.py replays every configuration with grpo_multistep.py and compares, without TRL.
This script needs TRL, in a venv of its own (the project itself never imports it), run from the root:

    python3 -m venv /tmp/trl && . /tmp/trl/bin/activate && pip install torch==2.13.0 trl==1.16.0
    python -m experiments.trl_golden

Both sides load the same files from tests/trl_parity/: a tiny Llama (model.safetensors: built the first
time, then only read, so that a rerun changes the golden numbers only if TRL's change) and its tokenizer.
TRL samples nothing: its _generate_single_turn (the hook after tokenization, before any forward pass) is
replaced by fixed completions, and the rewards are fixed numbers looked up by completion. Two of TRL's random
choices are fixed too, as the test fixes this project's: the dataset order (shuffle_dataset=False; the test
takes the rows in order too), and the shuffle of a generation batch's rows before it is split into
micro-batches (shuffle_sequence_dict, made the identity: this project keeps the rows in order).
"""
import json
import os
import sys
import tempfile
import warnings

os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "trl_parity")  # tests/test_trl_parity.py's
BOS_TOKENIZER = os.path.join(FIXTURES, "bos_tokenizer")
torch.set_num_threads(1)  # a 32-wide model gains nothing from threads; the machine may be busy
warnings.filterwarnings("ignore")  # TRL's advice for real runs (bf16, vLLM, ...) is noise here
transformers.utils.logging.disable_progress_bar()  # and so are progress bars for loading 150 kB

# ---- The data: 4 prompts, G = 4 fixed completions each, a fixed reward for each completion -----------------
CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world", "tl;dr: it was fine"] * 10
PROMPTS = ["the cat sat", "a dog ran in", "hello", "tl;dr: it was"]  # 3, 4, 1, 6 tokens: left padding
G, C = 4, 16  # num_generations, max_completion_length
# Completion lengths, EOS included; TRUNCATED ones have C tokens and no EOS. Groups 0 and 1 (the first
# optimizer step, as two micro-batches of 4) hold 59 and 28 tokens: unequal, which tells bnpo from dapo.
LENGTHS = [[C, 14, 13, 16], [3, 9, 5, 11], [7, C, 2, 10], [1, 6, C, 12]]
TRUNCATED = [[True, False, False, False], [False] * 4, [False, True, False, False],
             [False, False, True, False]]
# Varied advantages: ties, a negative group mean, an outlier, a group whose spread is small
REWARDS = [[1.0, 0.0, 0.5, 2.0], [0.3, -1.0, 0.3, 0.9], [0.0, 0.0, 0.25, 1.0], [-0.5, -0.4, -0.45, -0.1]]

LR = 2e-3  # Adam's first step moves each weight by ~LR: reuse steps clip 5 % of tokens, up to 57 % at T = 0.7
# AdamW's ε, on both sides (the test sets this project's): with the default 1e-8, Adam's first update
# LR·g/(|g| + ε) turns float noise in the few gradient entries of ~1e-9 into 1e-5 of a weight, which moves the
# next step's gradients by 1e-6..1e-5: chaos that says nothing about the loss. 1e-6 keeps it at float noise.
ADAM_EPSILON = 1e-6


def build_tokenizer():  # byte-level BPE trained on a few sentences: <pad> = 0, <eos> = 1, no BOS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def build_bos_tokenizer():
    """The same BPE with a BOS that tokenizing text adds (its post-processor) and the chat template writes:
    only to see where each side puts it (the model is not run on it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special_tokens = ["<pad>", "<eos>", "<bos>"]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=special_tokens,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                        bos_token="<bos>")
    tokenizer.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    return tokenizer


def build_model(tokenizer):  # 38k parameters, 150 kB as float32
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None)
    return LlamaForCausalLM(config)


def saved_model_and_tokenizer():
    if not os.path.exists(os.path.join(FIXTURES, "model.safetensors")):  # the first run only, then read
        tokenizer = build_tokenizer()
        tokenizer.save_pretrained(FIXTURES)
        build_model(tokenizer).save_pretrained(FIXTURES)
    if not os.path.exists(BOS_TOKENIZER):
        build_bos_tokenizer().save_pretrained(BOS_TOKENIZER)
    return PreTrainedTokenizerFast.from_pretrained(FIXTURES)


def fixed_completions(tokenizer):
    """{prompt ids: its G completions (token id lists)}, seeded; ids from 2 on: no <pad> or <eos> inside."""
    generator = torch.Generator().manual_seed(1234)
    table = {}
    for p, text in enumerate(PROMPTS):
        rows = []
        for n, truncated in zip(LENGTHS[p], TRUNCATED[p]):
            body = torch.randint(2, len(tokenizer), (n if truncated else n - 1,), generator=generator)
            rows.append(body.tolist() + ([] if truncated else [tokenizer.eos_token_id]))
        table[tuple(tokenizer(text)["input_ids"])] = rows
    return table


# ---- The configurations ------------------------------------------------------------------------------------
def configurations():
    """Each axis varied from a base, and the axes that interact (reuse × clip × KL × micro-batches) together.
    mb: 1 = one micro-batch of 8 completions (gradient_accumulation_steps=1), 2 = two of 4, with 59 and 28
    tokens (gradient_accumulation_steps=2). spg: steps_per_generation = 2 × gradient_accumulation_steps."""
    configs = []

    def add(loss_type, mu=1, mb=2, beta=0.0, bc=False, eps_high=None, temperature=1.0, spg=False,
            scale_rewards="group", level="token", mask_truncated=False, eps=0.2):
        per_device, ga = (8, 1) if mb == 1 else (4, 2)
        name = (f"{loss_type}-mu{mu}-mb{mb}-beta{beta}" + ("-bc" if beta and bc else "")
                + (f"-e{eps}" if eps != 0.2 else "") + (f"-eh{eps_high}" if eps_high else "")
                + (f"-T{temperature}" if temperature != 1 else "")
                + ("-spg" if spg else "") + ("-noscale" if scale_rewards == "none" else "")
                + ("-seq" if level == "sequence" else "") + ("-masktrunc" if mask_truncated else ""))
        configs.append({"name": name, "args": {
            "loss_type": loss_type, "num_iterations": mu, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": ga, "steps_per_generation": 2 * ga if spg else None, "beta": beta,
            "use_bias_correction_kl": bc, "epsilon": eps, "epsilon_high": eps_high,
            "temperature": temperature, "scale_rewards": scale_rewards, "importance_sampling_level": level,
            "mask_truncated_completions": mask_truncated, "learning_rate": LR}})

    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        for mu in (1, 2):                           # μ × micro-batches: the normalizers, the reuse step
            for mb in (1, 2):
                add(loss_type, mu, mb)
        for bc in (True, False):                    # the KL term, with and without the ratio weighting
            add(loss_type, 2, 2, beta=0.04, bc=bc)
        add(loss_type, 2, 1, beta=0.04, bc=True)
        add(loss_type, 2, 2, eps_high=0.28)                 # asymmetric clip (DAPO's clip-higher)
        add(loss_type, 2, 2, beta=0.04, bc=True, temperature=0.7)
        add(loss_type, 1, 1, temperature=0.7)
        add(loss_type, 1, 2, spg=True)              # steps_per_generation: the later mini-batch is stale
        add(loss_type, 2, 2, spg=True)                      # ... and each is reused
        add(loss_type, 2, 2, beta=0.04, eps_high=0.28, temperature=0.7, spg=True)  # all at once
    for loss_type in ("grpo", "dapo"):
        add(loss_type, 1, 1, spg=True)              # one micro-batch per step, two steps per generation
        add(loss_type, 2, 1, beta=0.04, bc=True, spg=True)
    add("dr_grpo", 2, 2, scale_rewards="none")              # Dr. GRPO as published: no division by the std
    add("bnpo", 2, 2, beta=0.04, bc=True, scale_rewards="none")
    for loss_type in ("grpo", "dapo"):              # GSPO's sequence-level ratio: μ = 1 (ρ = 1), μ = 2, with
        add(loss_type, 1, 2, level="sequence")      # the ratio-weighted KL and a stale mini-batch
        add(loss_type, 2, 2, level="sequence")
        add(loss_type, 2, 2, beta=0.04, bc=True, spg=True, level="sequence")
        add(loss_type, 2, 2, level="sequence", eps=3e-4, eps_high=4e-4)  # GSPO's ε: its clip is active
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):  # overlong filtering: the 3 truncated completions
        add(loss_type, 2, 2, mask_truncated=True)          # leave the loss and its normalizers
    add("grpo", 1, 1, mask_truncated=True)
    add("dapo", 2, 1, beta=0.04, bc=True, level="sequence", mask_truncated=True)
    return configs


# ---- Fingerprints of tensors, small enough for a JSON file -------------------------------------------------
def summary(t):
    """norm, projections on three fixed unit vectors (the first: the mean direction), the largest entry
    (index, value). test_trl_parity.py computes the same; each entry is bounded by the norm, its scale."""
    x = t.detach().double().flatten()
    i = torch.arange(1, len(x) + 1, dtype=torch.float64)
    directions = [torch.ones_like(i), torch.cos(0.618034 * i), torch.cos(2.718282 * i + 1.0)]
    k = int(x.abs().argmax())
    return [x.norm().item(), *[(x @ d / d.norm()).item() for d in directions], k, x[k].item()]


def rounded(x):  # 9 significant digits: every float32 survives the round trip
    if isinstance(x, float):
        return float(f"{x:.9g}")
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


# ---- Driving TRL -------------------------------------------------------------------------------------------
def run_trl(tokenizer, table, reward_of, args, max_steps, n_prompts, reward_funcs=None, **overrides):
    """TRL's GRPOTrainer for max_steps steps on the first n_prompts prompts. Returns what it computed: per
    generation batch its advantages (and cached log-probs), per optimizer step each micro-batch's loss,
    tokens, summed KL and clipped-token counts, and the gradients as AdamW receives them (clipped)."""
    config = dict(  # float32 on the CPU (TRL's defaults: bf16 and gradient checkpointing on), no clipping
        output_dir=tempfile.mkdtemp(prefix="trl-parity-"), use_cpu=True, bf16=False,
        gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, shuffle_dataset=False, max_grad_norm=0.0, lr_scheduler_type="constant",
        adam_epsilon=ADAM_EPSILON, num_generations=G, max_completion_length=C, max_steps=max_steps, seed=0,
        model_init_kwargs={"dtype": "float32"})
    config = trl.GRPOConfig(**{**config, **args, **overrides})
    funcs = reward_funcs or [lambda completion_ids, **kw: [reward_of[tuple(c)] for c in completion_ids]]
    trainer = trl.GRPOTrainer(model=FIXTURES, reward_funcs=funcs, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS[:n_prompts]}))
    record, micro_batches = {"generations": [], "steps": []}, []

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        # The rows come grouped, each prompt num_generations times in a row (TRL's RepeatSampler)
        assert all(prompt_ids[i] == prompt_ids[i - i % G] for i in range(len(prompt_ids)))
        return [table[tuple(ids)][i % G] for i, ids in enumerate(prompt_ids)], None  # no sampling logprobs

    generate_and_score, compute_loss = trainer._generate_and_score_completions, trainer._compute_loss

    def recorded_generate_and_score(inputs):
        out = generate_and_score(inputs)
        mask = out["completion_mask"].bool()
        rows = {"advantages": out["advantages"].tolist()}
        if "old_per_token_logps" in out:
            rows["old_per_token_logps"] = [x[m].tolist() for x, m in zip(out["old_per_token_logps"], mask)]
        record["generations"].append(rows)
        return out

    def recorded_compute_loss(model, inputs):
        metrics = trainer._metrics["train"]
        loss = compute_loss(model, inputs)
        tokens = int(inputs["completion_mask"].sum())  # one process: TRL's masked means are this batch's
        # At the sequence level TRL's clip ratios count sequences, this project's their tokens: not recorded
        # (the loss and the gradients, which the clip decides, are)
        clipped = {f"clip_{side}": round(metrics[f"clip_ratio/{side}_mean"][-1] * tokens)
                   if trainer.importance_sampling_level == "token" else None for side in ("low", "high")}
        micro_batches.append({"loss": loss.item(), "tokens": tokens,
                              "kl": metrics["kl"][-1] * tokens if "kl" in metrics else None, **clipped})
        return loss

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, *a, **kw):  # after TRL's gradient clipping, before AdamW
            grads = {n: p.grad for n, p in trainer.model.named_parameters()}
            total = torch.cat([g.flatten() for g in grads.values()]).norm().item()
            record["steps"].append({"micro_batches": list(micro_batches), "grad_norm": total,
                                    "grads": {n: summary(g) for n, g in grads.items()}})
            micro_batches.clear()

    trainer._generate_single_turn = generate
    trainer._generate_and_score_completions = recorded_generate_and_score
    trainer._compute_loss = recorded_compute_loss
    trainer.add_callback(Gradients())
    trainer.remove_callback(transformers.PrinterCallback)  # each step's log line: this script prints its own
    trainer.train()
    assert len(record["steps"]) == max_steps
    return record, trainer


def clipped_shares(steps):  # the share of each step's tokens whose ratio the clip stopped
    return [sum((m["clip_low"] or 0) + (m["clip_high"] or 0) for m in s["micro_batches"])
            / sum(m["tokens"] for m in s["micro_batches"]) for s in steps]


def main():
    tokenizer = saved_model_and_tokenizer()
    table = fixed_completions(tokenizer)
    reward_of = {tuple(c): REWARDS[p][j] for p, rows in enumerate(table.values()) for j, c in enumerate(rows)}
    trl_grpo.shuffle_sequence_dict = lambda d: d  # rows in order, as this project keeps them (see above)
    golden = {
        "versions": {"trl": trl.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "num_generations": G, "max_completion_length": C, "adam_epsilon": ADAM_EPSILON,
        "prompts": PROMPTS, "prompt_ids": [list(k) for k in table], "completions": list(table.values()),
        "rewards": REWARDS, "logps": {}, "configs": []}
    model = LlamaForCausalLM.from_pretrained(FIXTURES)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}

    for config in configurations():
        a = config["args"]
        ga = a["gradient_accumulation_steps"]
        S = (a["steps_per_generation"] or ga) // ga  # optimizer steps per generation batch
        n_prompts = a["per_device_train_batch_size"] * ga * S // G
        args = {k: v for k, v in a.items() if v is not None}  # None: TRL's own default (steps_per_generation)
        record, trainer = run_trl(tokenizer, table, reward_of, args, a["num_iterations"] * S, n_prompts)
        if "tokenization" not in golden:  # TRL's own tokenization of text and of chats, with a BOS to add
            trainer.processing_class = PreTrainedTokenizerFast.from_pretrained(BOS_TOKENIZER)
            chats = [[{"role": "user", "content": p}] for p in PROMPTS]
            golden["tokenization"] = {"text": trainer._tokenize_prompts(PROMPTS)[0],
                                      "chat": [list(x) for x in trainer._tokenize_prompts(chats)[0]]}
        for generation in record["generations"]:  # π_old's log-probs of all 16 completions under the initial
            logps = generation.pop("old_per_token_logps", None)  # weights: kept once per temperature
            if logps and len(logps) == 16:
                golden["logps"].setdefault(str(a["temperature"]), logps)
        golden["configs"].append({**config, **record})
        losses = [round(sum(m["loss"] for m in s["micro_batches"]), 5) for s in record["steps"]]
        print(f"{config['name']:42s} losses {losses} clipped "
              f"{[f'{c:.1%}' for c in clipped_shares(record['steps'])]}", flush=True)

    # End to end: three AdamW steps of train() with TRL's default loss (dapo), the ratio-weighted KL,
    # clip-higher, a reuse step, gradient clipping, a linear schedule, and two reward functions, the second
    # weighted 0.5 and None ("does not apply") for completions of odd length.
    def second_reward(completion_ids, **kw):
        return [None if len(c) % 2 else len(c) / C for c in completion_ids]

    funcs = [lambda completion_ids, **kw: [reward_of[tuple(c)] for c in completion_ids], second_reward]
    e2e_args = {"loss_type": "dapo", "num_iterations": 2, "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2, "beta": 0.04, "use_bias_correction_kl": True,
                "epsilon_high": 0.28, "learning_rate": LR, "reward_weights": [1.0, 0.5], "max_grad_norm": 0.5,
                "lr_scheduler_type": "linear"}
    record, trainer = run_trl(tokenizer, table, reward_of, e2e_args, 3, 4, reward_funcs=funcs)
    final = dict(trainer.model.named_parameters())
    golden["end_to_end"] = {"args": {**e2e_args, "max_steps": 3}, **record,
                            "update": {n: summary(final[n] - initial[n]) for n in initial}}
    for generation in record["generations"]:
        generation.pop("old_per_token_logps", None)
    losses = [round(sum(m["loss"] for m in s["micro_batches"]), 5) for s in record["steps"]]
    print("end to end: losses", losses, "clipped", [f"{c:.1%}" for c in clipped_shares(record["steps"])])

    with open(os.path.join(FIXTURES, "golden.json"), "w") as f:
        json.dump(rounded(golden), f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote golden.json: {os.path.getsize(os.path.join(FIXTURES, 'golden.json')) / 1e3:.0f} kB, "
          f"{len(golden['configs'])} configurations and an end-to-end run", file=sys.stderr)


if __name__ == "__main__":
    main()
