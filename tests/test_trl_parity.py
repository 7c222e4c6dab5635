"""This project computes what TRL 1.16.0's GRPOTrainer computes: the same advantages, loss and gradients.

experiments/trl_golden.py ran TRL, as the oracle, on a tiny Llama saved in tests/trl_parity/ with fixed
prompts, completions and rewards, in 72 configurations (the four loss types, β and the KL's ratio weighting,
ε_high, μ, one or two unequal micro-batches, the temperature, steps_per_generation, scale_rewards, GSPO's
sequence-level ratio, the masking of truncated completions) and an end-to-end run, and wrote what TRL
computed into golden.json. Each test replays that with grpo_multistep.py on the same weights and compares.
TRL is not needed: its numbers are in the file (the README there tells how to make it again).

Tolerance: 1e-5 of each quantity's scale (for a gradient entry, its tensor's norm). The two sides round in a
different order (TRL's fused LM head, this project's chunked one and its prompt sharing, positions shifted by
left padding, TRL's micro-batches padded to the generation batch's width): the largest difference measured is
3.6e-6 of the scale. Changing the algorithm moves them by 6e-4 (β 5 % too high) to 0.5 (ε and ε_high swapped).
"""

import copy
import json
import pathlib

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import grpo_long_runs
import grpo_multistep as gm

torch.set_num_threads(1)  # a 32-wide model gains nothing from threads, and loses a lot to a busy machine
HERE = pathlib.Path(__file__).parent / "trl_parity"
GOLDEN = json.loads((HERE / "golden.json").read_text())
G, C, PROMPTS = GOLDEN["num_generations"], GOLDEN["max_completion_length"], GOLDEN["prompts"]
COMPLETIONS = {tuple(ids): rows for ids, rows in zip(GOLDEN["prompt_ids"], GOLDEN["completions"])}
REWARD_OF = {tuple(c): r for rows, rewards in zip(GOLDEN["completions"], GOLDEN["rewards"])
             for c, r in zip(rows, rewards)}
TOKENIZER = PreTrainedTokenizerFast.from_pretrained(HERE)
MODEL = AutoModelForCausalLM.from_pretrained(HERE, dtype=torch.float32)  # each run trains a copy
RTOL = 1e-5  # of the scale: see the docstring
ATOL = 1e-6  # for numbers that cancel to ~0 (μ = 1, grpo: a group's advantages sum to 0, so does its loss)


# ---------------------------------------------------------------------------------------------------
# The inputs TRL had: fixed completions and rewards, the rows in order
# ---------------------------------------------------------------------------------------------------
def fixed_completions(model, tokenizer, prompt_ids, prompt_mask, args, eos_token_ids=None):
    """Stands in for generate_completions, as trl_golden.py's stand-in did for TRL's generation: each
    prompt's G completions from the golden file, right-padded to max_completion_length."""
    groups = [COMPLETIONS[tuple(ids[m.bool()].tolist())] for ids, m in zip(prompt_ids, prompt_mask)]
    completion_ids = torch.full((len(groups) * G, C), tokenizer.pad_token_id)
    for i, c in enumerate(c for group in groups for c in group):
        completion_ids[i, :len(c)] = torch.tensor(c)
    return (prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), completion_ids,
            gm.completion_mask(completion_ids, tokenizer.eos_token_id))


def fixed_reward(completion_ids, **kwargs):
    return [REWARD_OF[tuple(c)] for c in completion_ids]


def second_reward(completion_ids, **kwargs):  # the end-to-end run's: None ("does not apply") for odd lengths
    return [None if len(c) % 2 else len(c) / C for c in completion_ids]


def rows_in_order(trainer, k):  # generation batch k's prompts, the dataset's rows taken in turn
    args = trainer.args
    size = args.per_device_train_batch_size * (args.steps_per_generation or args.gradient_accumulation_steps)
    size = size // args.num_generations
    return [(k * size + i) % len(trainer.train_dataset) for i in range(size)]


def train_like_trl(tmp_path, monkeypatch, args, max_steps, n_prompts, reward_funcs=(fixed_reward,)):
    """train() on the golden inputs. Returns what trl_golden.py recorded of TRL: each generation batch's
    advantages; per optimizer step each micro-batch's loss, tokens, KL sum and clipped-token counts, and the
    gradients AdamW receives; and the metrics each step logged."""
    monkeypatch.setattr(gm, "generate_completions", fixed_completions)
    # TRL ran with shuffle_dataset=False: the rows in order. This project draws a seeded order: in order too.
    monkeypatch.setattr(gm, "prompt_rows", rows_in_order)
    config = {"output_dir": str(tmp_path / "out"), "num_generations": G, "max_completion_length": C,
              "max_steps": max_steps, "logging_steps": 1, "save_steps": 10**6, "max_grad_norm": 0.0,
              "lr_scheduler_type": "constant", **args}
    trainer = gm.GRPOTrainer(copy.deepcopy(MODEL), list(reward_funcs), gm.GRPOConfig(**config),
                             Dataset.from_dict({"prompt": PROMPTS[:n_prompts]}), processing_class=TOKENIZER)
    for group in trainer.optimizer.param_groups:  # TRL's adam_epsilon (trl_golden.py says why not 1e-8)
        group["eps"] = GOLDEN["adam_epsilon"]
    record, micro_batches = {"generations": [], "steps": [], "metrics": []}, []

    loss = gm.grpo_loss
    def recorded_loss(logps, old_logps, ref_logps, advantages, mask, *rest):
        out = loss(logps, old_logps, ref_logps, advantages, mask, *rest)
        stats = {k: v.item() for k, v in out[1].items()}
        micro_batches.append({"loss": out[0].item(), "tokens": int(mask.sum()), "kl": stats.get("kl"),
                              "clip_low": stats["clip_low"], "clip_high": stats["clip_high"]})
        return out
    monkeypatch.setattr(gm, "grpo_loss", recorded_loss)

    generate_and_score = trainer.generate_and_score
    def recorded_generate_and_score(k):
        batch, metrics = generate_and_score(k)
        record["generations"].append({"advantages": batch["advantages"].tolist()})
        return batch, metrics
    trainer.generate_and_score = recorded_generate_and_score

    def before_adamw(*_):  # after gradient clipping, as TRL's on_pre_optimizer_step
        record["steps"].append({"micro_batches": list(micro_batches),
                                "grads": {n: p.grad.clone() for n, p in trainer.model.named_parameters()}})
        micro_batches.clear()
    trainer.optimizer.register_step_pre_hook(before_adamw)
    trainer.log = record["metrics"].append
    trainer.train()
    return record, trainer


# ---------------------------------------------------------------------------------------------------
# Comparing: each number against TRL's, relative to its scale
# ---------------------------------------------------------------------------------------------------
def summary(t):
    """trl_golden.py's fingerprint of a tensor: norm, projections on three fixed unit vectors (the first: the
    mean direction), its largest entry (index, value)."""
    x = t.detach().double().flatten()
    i = torch.arange(1, len(x) + 1, dtype=torch.float64)
    directions = [torch.ones_like(i), torch.cos(0.618034 * i), torch.cos(2.718282 * i + 1.0)]
    k = int(x.abs().argmax())
    return [x.norm().item(), *[(x @ d / d.norm()).item() for d in directions], k, x[k].item()]


def tensor_error(ours, theirs):
    """The largest difference between our tensor and TRL's fingerprint of its own (the norm, the three
    projections, and TRL's largest entry, read at TRL's index), relative to TRL's norm: it bounds each."""
    norm, *projections, k, value = theirs
    mine = summary(ours)
    diffs = [abs(a - b) for a, b in zip(mine[:4], [norm, *projections])] + [abs(ours.flatten()[k] - value)]
    return float(max(diffs)) / max(norm, 1e-12)


def number_error(ours, theirs):  # relative, but ATOL where a number cancels to ~0
    return abs(ours - theirs) / (abs(theirs) + ATOL / RTOL)


def step_errors(ours, theirs):
    """{quantity: its largest error} in one optimizer step, and where the largest gradient error is."""
    errors, where = {"loss": 0.0, "kl": 0.0, "gradient": 0.0}, ""
    assert [m["tokens"] for m in ours["micro_batches"]] == [m["tokens"] for m in theirs["micro_batches"]]
    for a, b in zip(ours["micro_batches"], theirs["micro_batches"]):
        errors["loss"] = max(errors["loss"], number_error(a["loss"], b["loss"]))
        assert (a["kl"] is None) == (b["kl"] is None)
        if a["kl"] is not None:
            errors["kl"] = max(errors["kl"], number_error(a["kl"], b["kl"]))
        # Counted exactly alike in every configuration; one token is allowed to flip on another machine,
        # where a ratio within float noise of 1 - ε or 1 + ε_high could round to the other side. (At the
        # sequence level TRL counts clipped sequences, this project their tokens: None, not compared.)
        if b["clip_low"] is not None:
            assert abs(a["clip_low"] - b["clip_low"]) <= 1, (a, b)
            assert abs(a["clip_high"] - b["clip_high"]) <= 1, (a, b)
    assert ours["grads"].keys() == theirs["grads"].keys()
    for name, g in ours["grads"].items():
        e = tensor_error(g, theirs["grads"][name])
        if e > errors["gradient"]:
            errors["gradient"] = e
            where = f"the largest gradient error is in {name}"
    return errors, where


def assert_close_to_trl(record, golden):
    assert len(record["generations"]) == len(golden["generations"])
    for ours, theirs in zip(record["generations"], golden["generations"]):
        torch.testing.assert_close(torch.tensor(ours["advantages"]), torch.tensor(theirs["advantages"]),
                                   rtol=RTOL, atol=ATOL, msg="advantages")
    assert len(record["steps"]) == len(golden["steps"])
    for step, (ours, theirs) in enumerate(zip(record["steps"], golden["steps"]), 1):
        errors, where = step_errors(ours, theirs)
        assert max(errors.values()) < RTOL, f"step {step}: errors {errors}; {where}"


# ---------------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "chat"])
def test_prompts_tokenize_to_trls_ids_with_one_bos(kind):
    """TRL 1.16 tokenizes text with the tokenizer's special tokens (here a BOS) and a chat through its
    template, which writes the BOS itself: one BOS either way, and so here."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(HERE / "bos_tokenizer")
    prompts = PROMPTS if kind == "text" else [[{"role": "user", "content": p}] for p in PROMPTS]
    ids, mask = gm.tokenize_prompts(tokenizer, prompts, None)
    assert [row[m.bool()].tolist() for row, m in zip(ids, mask)] == GOLDEN["tokenization"][kind]
    ids, mask = gm.tokenize_prompts(TOKENIZER, PROMPTS, None)  # the parity runs' tokenizer adds none
    assert [row[m.bool()].tolist() for row, m in zip(ids, mask)] == GOLDEN["prompt_ids"]


@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_log_probs_equal_trls_at_the_sampling_temperature(temperature):
    """π_old's per-token log-probs of all 16 completions under the initial weights, log_softmax(logits / T)
    on both sides: this project's chunked, prompt-sharing per_token_logps and its plain definition."""
    ids, mask = gm.tokenize_prompts(TOKENIZER, PROMPTS, None)
    _, _, completion_ids, completion_mask = fixed_completions(MODEL, TOKENIZER, ids, mask, None)
    prompt_ids, prompt_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    theirs = torch.tensor([x for row in GOLDEN["logps"][temperature] for x in row])
    for module in (grpo_long_runs, gm):  # the layer's faster pass, the core's plain one
        def per_token_logps(*args):  # its log-probs, without the entropies beside them
            return module.per_token_logps(*args)[0]
        with torch.no_grad():
            logps = per_token_logps(MODEL, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                    float(temperature))
        torch.testing.assert_close(logps[completion_mask.bool()], theirs, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("config", GOLDEN["configs"], ids=[c["name"] for c in GOLDEN["configs"]])
def test_each_configuration_has_trls_advantages_loss_kl_clipping_and_gradients(tmp_path, monkeypatch, config):
    """Every optimizer step of the configuration (μ·S of them, the reuse steps too, on weights AdamW has
    moved), micro-batch by micro-batch: the loss, the KL, the clipped tokens; then the gradient."""
    a, ga = config["args"], config["args"]["gradient_accumulation_steps"]
    S = (a["steps_per_generation"] or ga) // ga  # optimizer steps per generation batch
    n_prompts = a["per_device_train_batch_size"] * ga * S // G
    record, _ = train_like_trl(tmp_path, monkeypatch, a, a["num_iterations"] * S, n_prompts)
    assert_close_to_trl(record, config)
    if a["epsilon"] < 0.01:  # GSPO's ε: the reuse step's sequence-level ratios leave [1 - ε, 1 + ε_high]
        assert sum(m["clip_low"] + m["clip_high"] for m in record["steps"][1]["micro_batches"]) > 0
    for metrics, theirs in zip(record["metrics"], config["steps"]):  # the logged clip ratios: token-weighted
        if a["importance_sampling_level"] == "sequence":
            break
        tokens = sum(m["tokens"] for m in theirs["micro_batches"])
        for side in ("low", "high"):
            clipped = sum(m[f"clip_{side}"] for m in theirs["micro_batches"])
            assert abs(metrics[f"clip_ratio/{side}_mean"] * tokens - clipped) <= 1.0


def test_three_adamw_steps_of_train_end_at_trls_weights(tmp_path, monkeypatch):
    """End to end: TRL's default loss (dapo) with the KL (ratio-weighted, TRL's default), clip-higher, a reuse
    step, gradient clipping, a linear schedule, and two weighted reward functions, one of them None for some
    completions. Three AdamW steps on two generation batches, and the weights end where TRL's did."""
    e2e = GOLDEN["end_to_end"]
    args = {k: v for k, v in e2e["args"].items() if k != "max_steps"}
    record, trainer = train_like_trl(tmp_path, monkeypatch, args, max_steps=e2e["args"]["max_steps"],
                                     n_prompts=4, reward_funcs=(fixed_reward, second_reward))
    assert_close_to_trl(record, e2e)
    initial = dict(MODEL.named_parameters())
    for name, p in trainer.model.named_parameters():  # the update: what training changed
        assert tensor_error(p.detach() - initial[name].detach(), e2e["update"][name]) < RTOL, name


def test_the_golden_file_covers_each_axis():
    """What trl_golden.py promises, so that a golden file made again cannot quietly drop a case."""
    args = [c["args"] for c in GOLDEN["configs"]]
    assert {a["loss_type"] for a in args} == {"grpo", "bnpo", "dapo", "dr_grpo"}
    kl_terms = {(a["beta"], a["use_bias_correction_kl"]) for a in args}  # none, with and without the ratio
    assert kl_terms >= {(0, False), (0.04, True), (0.04, False)}
    assert {a["epsilon_high"] for a in args} == {None, 0.28, 4e-4}  # 4e-4 with ε = 3e-4: GSPO's clip range
    assert {a["temperature"] for a in args} == {1.0, 0.7}
    assert {a["scale_rewards"] for a in args} == {"group", "none"}
    assert {a["loss_type"] for a in args if a["steps_per_generation"]} >= {"grpo", "dapo"}
    for field, value in (("importance_sampling_level", "sequence"), ("mask_truncated_completions", True)):
        assert {a["num_iterations"] for a in args if a[field] == value} == {1, 2}, field

    def clipped_share(step):
        return (sum((m["clip_low"] or 0) + (m["clip_high"] or 0) for m in step["micro_batches"])
                / sum(m["tokens"] for m in step["micro_batches"]))

    # μ = 2's reuse step on two unequal micro-batches, clipping a real share of the tokens
    reuse = [c["steps"][1] for c in GOLDEN["configs"] if c["args"]["num_iterations"] == 2
             and c["args"]["steps_per_generation"] is None and c["args"]["gradient_accumulation_steps"] == 2]
    assert all(len({m["tokens"] for m in s["micro_batches"]}) == 2 for s in reuse)
    assert any(clipped_share(s) > 0.04 for s in reuse)
    # The truncated completions: there to be masked (mask_truncated_completions)
    assert sum(c[-1] != TOKENIZER.eos_token_id for rows in GOLDEN["completions"] for c in rows) == 3
