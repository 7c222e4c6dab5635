"""grpo_long_runs.py's guarantees, as executable checks: a failure keeps the finished steps, a signal never
waits for more than a weight update or a checkpoint write, torchrun's processes make the same updates as
one, a used output_dir is refused, trackers get every row, and the faster log-prob pass is the plain one.

Everything runs offline on a tiny Llama and a word-level tokenizer made here."""

import importlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                          PreTrainedTokenizerFast)

import grpo_multistep as gm
import grpo_long_runs as lr
from grpo_long_runs import GRPOConfig, GRPOTrainer, per_token_logps

torch.use_deterministic_algorithms(True)
torch.set_num_threads(1)  # a 32-wide model gains nothing from threads, and loses a lot to a busy machine
PROMPTS = ["the cat", "a dog", "hello", "tl;dr:", "the park", "world", "it was", "on the mat"]
HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1",  # child processes import this file and the modules
             "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}


def make_tokenizer():
    """Words of the prompts, then filler words up to 300 ids: a reward on ids below 150 has room to learn."""
    words = sorted({w for p in PROMPTS for w in p.split()}) + [f"w{i}" for i in range(280)]
    vocab = {word: i for i, word in enumerate(["<pad>", "<eos>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def make_model(tokenizer, seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                                        pad_token_id=tokenizer.pad_token_id))


def short_is_good(completion_ids, **kwargs):
    """A toy reward a random model can learn: the share of a completion's tokens with an id below 150."""
    return [sum(t < 150 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def plain_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The model's own logits over prompt + completion: one pass, no cache, no sharing."""
    mask = torch.cat([prompt_mask, completion_mask], 1)
    return model(input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=mask,
                 position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits                 # (b, P+C, V)


def lora(**overrides):
    """TRL's usual LoRA: rank 4 on the attention's query and value projections."""
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                              "task_type": "CAUSAL_LM", **overrides})


EVAL_PROMPTS = ["a held out prompt", "another one", "the third", "and a fourth"]


# Two steps of 8 completions, 4 per prompt, in micro-batches of 4; a large rate, so that a step shows.
SMALL = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, seed=0,
             max_prompt_length=16, max_completion_length=12, max_steps=2, learning_rate=1e-2, logging_steps=1,
             max_grad_norm=0.0)


def make_trainer(tmp_path, reward_funcs=short_is_good, dataset=None, tokenizer=None, model=None, **kwargs):
    """The layer's trainer on the tiny model, writing to tmp_path/out. kwargs: GRPOConfig's fields, and the
    trainer's eval_dataset or peft_config."""
    if tokenizer is None:
        tokenizer = make_tokenizer()
    if dataset is None:
        dataset = Dataset.from_dict({"prompt": PROMPTS})
    extra = {name: kwargs.pop(name) for name in ("eval_dataset", "peft_config") if name in kwargs}
    config = GRPOConfig(**{**SMALL, "output_dir": str(tmp_path / "out"), **kwargs})
    model = model or make_model(tokenizer)
    return GRPOTrainer(model, reward_funcs, config, dataset, processing_class=tokenizer, **extra)


def metrics_of(out):
    """metrics.jsonl without the timings: what a resumed run must log exactly like an uninterrupted one."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "elapsed"} for r in rows]


def checkpoints(out):
    return [os.path.basename(c) for c in lr.list_checkpoints(str(out))]


PROMPTS = ["the cat", "a dog", "hello", "tl;dr:", "the park", "world", "it was", "on the mat"]


@pytest.mark.parametrize("temperature,bias", [(1.0, False), (0.7, False), (0.7, True)])
def test_lean_chunked_log_probs_equal_log_softmax_of_tempered_logits(temperature, bias, monkeypatch):
    """The lean path (hidden states -> LM head in chunks of 5 tokens -> logit - logsumexp, and a
    hand-written backward, onehot(y) - softmax(z)) gives the log-probs and the gradients of the plain
    log_softmax of the model's tempered logits, for any weight of each token in the loss."""
    monkeypatch.setattr(lr, "CHUNK", 5)
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
        lean = lr.TokenLogps.apply(hidden, targets, 0.7, weight, None)[0]
        logits = torch.nn.functional.linear(hidden, weight).float() / 0.7  # bf16 products, as bf16=True
        plain = logits.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lean, plain, rtol=0, atol=1e-5)
    lean_grads = torch.autograd.grad((lean * weights).sum(), (hidden, weight))
    plain_grads = torch.autograd.grad((plain * weights).sum(), (hidden, weight))
    for a, b in zip(lean_grads, plain_grads):  # autograd's backward multiplies in bf16, TokenLogps in float32
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


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
    plain = gm.per_token_logps(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)[0]
    (plain * completion_mask).sum().backward()
    torch.testing.assert_close(lean, plain * completion_mask, rtol=0, atol=1e-5)
    logits = plain_logits(model, prompt_ids, prompt_mask, completion_ids,
                          completion_mask)[:, ids.size(1) - 1:-1]
    # the model's own
    by_hand = (logits / 0.7).log_softmax(-1).gather(-1, completion_ids[..., None]).squeeze(-1)
    torch.testing.assert_close(plain, by_hand, rtol=0, atol=1e-5)
    for a, p in zip(lean_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-4, atol=1e-6)


def test_a_model_whose_logits_are_not_the_lm_head_output_is_refused(tmp_path):
    model = make_model(make_tokenizer())
    forward = model.forward  # stands in for softcapping or scaling inside a model's forward
    model.forward = lambda *a, **k: (lambda out: setattr(out, "logits", out.logits * 2) or out)(
        forward(*a, **k))
    with pytest.raises(ValueError, match="logits are not lm_head"):
        make_trainer(tmp_path, model=model)


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
    script = (PR2899_SCRIPT.replace("from trl import", "from grpo_long_runs import")
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
    return prompt_ids, prompt_mask, completion_ids, gm.completion_mask(completion_ids, tokenizer.eos_token_id)


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_make_the_same_updates_as_one(tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "generate_completions", fixed_completions)
    single = train_on_fixed_completions(tmp_path / "single", world_size=1)
    torch.multiprocessing.spawn(data_parallel_worker, args=(2, free_port(), tmp_path), nprocs=2)
    double = torch.load(tmp_path / "params.pt")
    for run in DATA_PARALLEL_RUNS:
        (grads_1, params_1), (grads_2, params_2) = single[run], double[run]
        assert len(grads_1) == len(grads_2) == 2
        for step_1, step_2 in zip(grads_1, grads_2):  # the same gradient, scale included, up to float noise
            for a, b in zip(step_1, step_2):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=f"{run}")
        # Then the same weights, up to Adam's amplification of float noise in near-zero gradients
        # (learning rate 1e-2: the weights move by about 2e-2).
        for a, b in zip(params_1, params_2):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"{run}")


def interrupted_after_step(step, trainer):
    """The trainer, with Ctrl-C pressed right after `step`'s row is logged."""
    def log(row):
        GRPOTrainer.log(trainer, row)
        if row["step"] == step:
            raise KeyboardInterrupt
    trainer.log = log
    return trainer


def test_ctrl_c_writes_a_checkpoint_that_resumes_bit_identically(tmp_path):
    """Ctrl-C after step 3's row, inside a μ = 2 generation batch: checkpoint-3 holds the batch, and the run
    resumed from it ends as a run that never stopped."""
    trainer = interrupted_after_step(3, make_trainer(tmp_path, max_steps=4, save_steps=100, num_iterations=2))
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert checkpoints(tmp_path / "out") == ["checkpoint-3"]
    assert_resumes_like_a_run_that_never_stopped(tmp_path, num_iterations=2)


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


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    make_trainer(tmp_path, max_steps=4, save_steps=1, save_total_limit=2).train()
    assert checkpoints(tmp_path / "out") == ["checkpoint-3", "checkpoint-4"]


def assert_resumes_like_a_run_that_never_stopped(tmp_path, reward=short_is_good, **overrides):
    """Finish tmp_path/out's 4-step run from its newest checkpoint; compare with a run that never stopped."""
    resumed, whole = (make_trainer(tmp_path, reward, max_steps=4, save_steps=100,
                                   output_dir=str(tmp_path / d), **overrides) for d in ("out", "whole"))
    resumed.train(resume_from_checkpoint=True)
    whole.train()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))
    assert metrics_of(tmp_path / "out") == metrics_of(tmp_path / "whole")


def test_a_failing_reward_function_keeps_the_finished_steps(tmp_path, child_at):
    """A reward failing in step 3 leaves checkpoint-2, which resumes exactly like a run that never failed."""
    calls = []
    def flaky_reward(completion_ids, **kw):  # short_is_good, but its 3rd call raises
        calls.append(1)
        if len(calls) == 3:
            raise ConnectionError("the grader is down")
        return short_is_good(completion_ids)
    with pytest.raises(RuntimeError, match="reward function 'flaky_reward' failed: ConnectionError"):
        make_trainer(tmp_path, flaky_reward, max_steps=4, save_steps=100).train()
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert_resumes_like_a_run_that_never_stopped(tmp_path, flaky_reward)  # its 3rd call is past: it works now


A_60_S_CALL_IN_STEP_3 = """
import functools, time
from pathlib import Path
import test_grpo_long_runs as t, grpo_multistep as gm
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


def run_until(child_at, script, flag, signum, command=None):
    """Run `script` in a child process, send it `signum` once `flag` exists; its exit status and the seconds
    from the signal to its exit."""
    with child_at(flag, script, command) as process:
        sent = time.monotonic()
        process.send_signal(signum)
        return process.wait(timeout=60), time.monotonic() - sent


@pytest.mark.parametrize("phase", ["generate", "reward"])
def test_sigterm_stops_a_60_s_step_within_seconds_keeping_the_finished_steps(tmp_path, phase, child_at):
    """SIGTERM (preemption: SLURM and Kubernetes send SIGKILL about 30 s later) during step 3's 60 s
    generation or reward call: that step is abandoned, checkpoint-2 is written, and the process exits with
    status 143 (128 + 15) within seconds. The checkpoint resumes bit-identically."""
    flag = tmp_path / "slow"
    script = A_60_S_CALL_IN_STEP_3.format(flag=str(flag), tmp=str(tmp_path), phase=phase)
    code, seconds = run_until(child_at, script, flag, signal.SIGTERM)
    assert code == 143 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert_resumes_like_a_run_that_never_stopped(tmp_path)


A_60_S_EVALUATION_AT_STEP_2 = """
import time
from pathlib import Path
from datasets import Dataset
import test_grpo_long_runs as t
def slow_judge(completions, **kwargs):  # the held-out prompts' grader takes 60 s
    open({flag!r}, "w").close()
    time.sleep(60)
    return [0.0] * len(completions)
trainer = t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100, eval_strategy="steps", eval_steps=2,
                         eval_dataset=Dataset.from_dict({{"prompt": ["held out", "prompts", "a", "b"]}}))
trainer.reward_funcs = [t.short_is_good]
def evaluate():  # the same trainer, graded by the slow judge while it evaluates
    trainer.reward_funcs = [slow_judge]
    return t.GRPOTrainer.evaluate(trainer)
trainer.evaluate = evaluate
trainer.train()
"""


def test_sigterm_during_a_60_s_evaluation_exits_within_seconds_with_the_finished_step(tmp_path, child_at):
    """An evaluation is not held against a signal: SIGTERM in step 2's 60 s evaluation writes step 2's row
    (without the evaluation's metrics) and checkpoint, as its update is done, and exits with 143 within
    seconds. The checkpoint resumes to the weights of a run that never stopped."""
    flag = tmp_path / "judging"
    code, seconds = run_until(child_at, A_60_S_EVALUATION_AT_STEP_2.format(flag=str(flag), tmp=str(tmp_path)),
                              flag, signal.SIGTERM)
    assert code == 143 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2]
    resumed, whole = (make_trainer(tmp_path, max_steps=4, save_steps=100, output_dir=str(tmp_path / d))
                      for d in ("out", "whole"))
    resumed.train(resume_from_checkpoint=True)
    whole.train()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), resumed.model.parameters()))


SIGTERM_DURING_THE_UPDATE_OF_STEP_3 = """
import os, signal
from pathlib import Path
import test_grpo_long_runs as t
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
    script = SIGTERM_DURING_THE_UPDATE_OF_STEP_3.format(tmp=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=CHILD_ENV)
    assert result.returncode == 143, result.stderr[-3000:]
    assert checkpoints(tmp_path / "out") == ["checkpoint-3"]
    assert_resumes_like_a_run_that_never_stopped(tmp_path)


def test_a_non_finite_gradient_stops_training_with_the_weights_untouched_and_a_checkpoint(tmp_path,
                                                                                        monkeypatch):
    """A NaN loss in step 2 stops the run before the NaN reaches a weight; step 1 is checkpointed."""
    loss, calls = gm.grpo_loss, []
    def nan_in_step_2(*args):
        calls.append(1)
        value, stats = loss(*args)
        if len(calls) > 2:  # micro-batches 3 and 4 are step 2's
            value = value * math.nan
        return value, stats
    monkeypatch.setattr(gm, "grpo_loss", nan_in_step_2)
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=100)
    after_step_1 = []
    trainer.optimizer.register_step_post_hook(
        lambda *_: after_step_1.append([p.detach().clone() for p in trainer.model.parameters()]))
    with pytest.raises(RuntimeError, match="non-finite"):
        trainer.train()
    assert len(after_step_1) == 1 and checkpoints(tmp_path / "out") == ["checkpoint-1"]
    assert all(torch.equal(a, b) for a, b in zip(after_step_1[0], trainer.model.parameters()))


def test_train_outside_the_main_thread_runs_without_signal_handlers(tmp_path):
    """Only the main thread can set signal handlers: elsewhere train() sets none, and runs."""
    trainer, handler = make_trainer(tmp_path), signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=trainer.train)
    thread.start()
    thread.join()
    assert trainer.step == 2 and signal.getsignal(signal.SIGTERM) is handler


ONE_RANK_FAILS = """
import os, sys
from pathlib import Path
os.environ.update(RANK=sys.argv[1], LOCAL_RANK=sys.argv[1], WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="{port}")
import test_grpo_long_runs as t
calls = []
def reward(completion_ids, **kw):
    calls.append(1)
    if sys.argv[1] == "0" and len(calls) == 2:  # only rank 0 fails, in step 2
        raise ConnectionError("the grader is down")
    return t.short_is_good(completion_ids)
t.make_trainer(Path({tmp!r}), reward, max_steps=4, save_steps=100).train()
"""


def test_a_failure_on_one_rank_ends_every_rank_and_keeps_the_finished_steps(tmp_path):
    """Under torchrun, an error on one rank ends every rank (none waits in a collective) with a checkpoint."""
    script = ONE_RANK_FAILS.format(port=free_port(), tmp=str(tmp_path))
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank)], env=CHILD_ENV) for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and None in [p.poll() for p in ranks]:
        time.sleep(0.5)
    codes = [p.poll() for p in ranks]
    for p in ranks:
        p.kill()
        p.wait()
    assert None not in codes, f"a rank still runs 120 s after rank 0's error (exit codes {codes})"
    assert 0 not in codes, f"the failed run must end in an error on every rank (exit codes {codes})"
    assert checkpoints(tmp_path / "out") == ["checkpoint-1"]


TORCHRUN_WORKER = """
import os, sys, time
from pathlib import Path
import test_grpo_long_runs as t
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
t.torch.distributed.destroy_process_group()
"""


def test_sigterm_to_torchrun_stops_every_rank_within_seconds_with_a_checkpoint(tmp_path, child_at):
    """torchrun forwards SIGTERM to its workers (and SIGKILLs them 30 s later). With rank 1 inside a 60 s
    reward call of step 3 and rank 0 waiting for it in a collective, both stop within seconds; checkpoint-2
    holds each rank's file, and it resumes bit-identically."""
    worker, flag = tmp_path / "worker.py", tmp_path / "slow"
    worker.write_text(TORCHRUN_WORKER.format(flag=str(flag), tmp=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(worker)]
    command = [*torchrun, "slow", str(tmp_path / "out"), "new"]
    code, seconds = run_until(child_at, None, flag, signal.SIGTERM, command=command)
    assert code != 0 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    ranks = sorted(n for n in os.listdir(tmp_path / "out" / "checkpoint-2") if n.startswith("rank"))
    assert ranks == ["rank_0.pt", "rank_1.pt"]
    for args in (["fast", str(tmp_path / "out"), "resume"], ["fast", str(tmp_path / "whole"), "new"]):
        done = subprocess.run([*torchrun, *args], env=CHILD_ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-5000:]
    weights = [gm.AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("out", "whole")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert metrics_of(tmp_path / "out") == metrics_of(tmp_path / "whole")


TWO_RANKS_RESUME = """
import os, sys
from pathlib import Path
import test_grpo_long_runs as t
trainer = t.make_trainer(Path({tmp!r}), max_steps=6, save_steps=int(sys.argv[2]),
                         per_device_train_batch_size=4, gradient_accumulation_steps=1, num_iterations=2,
                         steps_per_generation=2, output_dir=sys.argv[1])
trainer.train(resume_from_checkpoint=sys.argv[3] if sys.argv[3] != "new" else None)
t.torch.distributed.destroy_process_group()
"""


def test_two_processes_resume_bit_identically_inside_a_generation_batch(tmp_path):
    """μ = 2, S = 2 under torchrun: checkpoint-2 falls inside a generation batch (steps 0-3). Each process
    saved its own part of the batch; resumed, both make the updates of a run that never stopped."""
    worker = tmp_path / "worker.py"
    worker.write_text(TWO_RANKS_RESUME.format(tmp=str(tmp_path)))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                str(worker)]
    for args in ([str(tmp_path / "whole"), "2", "new"],
                 [str(tmp_path / "out"), "100", str(tmp_path / "whole" / "checkpoint-2")]):
        done = subprocess.run([*torchrun, *args], env=CHILD_ENV, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-5000:]
    assert sorted(os.listdir(tmp_path / "whole" / "checkpoint-2")).count("rank_1.pt") == 1
    weights = [gm.AutoModelForCausalLM.from_pretrained(tmp_path / d).state_dict() for d in ("out", "whole")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_fresh_run_refuses_an_output_dir_that_holds_files_and_names_them(tmp_path):
    """A user's config.json there would be overwritten by the final save, another run's checkpoints mixed
    with this one's. overwrite_output_dir=True deletes the earlier run's checkpoints and metrics only."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("the user's")
    with pytest.raises(ValueError, match="output_dir .* holds config.json: .*overwrite_output_dir=True"):
        make_trainer(tmp_path).train()
    assert sorted(os.listdir(out)) == ["config.json"]
    (out / "config.json").unlink()
    make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    (out / "notes.txt").write_text("mine")
    trainer = make_trainer(tmp_path, max_steps=1, save_steps=100, overwrite_output_dir=True).train()
    assert checkpoints(out) == ["checkpoint-1"] and [r["step"] for r in metrics_of(out)] == [1]
    assert (out / "notes.txt").read_text() == "mine" and trainer.step == 1


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """With activations recomputed, per_token_logps takes its one-pass path (no shared prompt cache)."""
    grads = {}
    for checkpointing in (False, True):
        trainer = make_trainer(tmp_path / str(checkpointing), num_iterations=2, beta=0.1, max_steps=1,
                               gradient_checkpointing=checkpointing)
        def keep(*args, key=checkpointing, model=trainer.model):  # the gradients AdamW is about to apply
            grads[key] = [p.grad.clone() for p in model.parameters()]
        trainer.optimizer.register_step_pre_hook(keep)
        trainer.train()
        assert trainer.model.is_activation_checkpointing == checkpointing
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_importing_works_with_any_transformers_and_the_trainer_names_an_older_one():
    """grpo_loss and group_advantages copy into any project: the version check runs when a trainer is made."""
    code = ("import transformers; transformers.__version__ = '5.10.0'; import grpo_long_runs as lr; "
            "print('imported'); lr.GRPOTrainer('model', print)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CHILD_ENV)
    assert "imported" in result.stdout
    assert "GRPOTrainer needs transformers >= 5.24, found 5.10.0" in result.stderr


def test_evaluation_needs_a_held_out_set(tmp_path):
    with pytest.raises(ValueError, match=r"\(eval_strategy='steps' or evaluate\(\)\) needs an eval_dataset"):
        make_trainer(tmp_path, eval_strategy="steps").train()
    with pytest.raises(TypeError, match="eval_dataset must be a datasets.Dataset"):
        make_trainer(tmp_path, eval_dataset="prompts.jsonl")


def test_report_to_tensorboard_writes_the_scalars_of_metrics_jsonl_at_the_same_steps(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    make_trainer(tmp_path, report_to="tensorboard", max_steps=3).train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    (run,) = (tmp_path / "out" / "runs").iterdir()
    events = event_accumulator.EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(rows[0]) - {"step"}
    for tag in events.Tags()["scalars"]:
        logged = [(e.step, e.value) for e in events.Scalars(tag)]
        assert logged == [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows], tag


def test_report_to_wandb_offline_and_trackio_log_each_row_at_its_step(tmp_path, monkeypatch):
    """wandb in offline mode (the run it starts is real, and finished; what it is sent is recorded) and
    trackio (local: its own database, read back) receive every row of metrics.jsonl at its step."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # (read when trackio is first imported)
    monkeypatch.setenv("TRACKIO_PROJECT", "grpo-test")
    pytest.importorskip("trackio")
    sent, init = [], wandb.init
    class Recorded:  # the offline run, and what it is sent
        def __init__(self, **kwargs):
            self.run = init(**kwargs)
        def log(self, metrics, step):
            sent.append((step, dict(metrics)))
            self.run.log(metrics, step=step)
        def finish(self):
            self.run.finish()
    monkeypatch.setattr(wandb, "init", Recorded)
    make_trainer(tmp_path, report_to=["wandb", "trackio"], max_steps=2).train()
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert sent == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in rows]
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    storage = importlib.import_module("trackio.sqlite_storage").SQLiteStorage
    (run,) = storage.get_runs("grpo-test")
    stored = [{k: v for k, v in log.items() if k != "timestamp"}
              for log in storage.get_logs("grpo-test", run)]
    assert stored == [{k: pytest.approx(v) for k, v in r.items()} for r in rows]


def test_report_to_names_known_trackers_that_are_installed(monkeypatch):
    """TRL's forms: a name, a list, 'all' (what is installed) or 'none'; a missing package fails at once."""
    assert GRPOConfig().report_to == [] and GRPOConfig(report_to="none").report_to == []
    with pytest.raises(ValueError,
                       match=r"report_to names \['mlflow'\]: each must be one of \('tensorboard', 'wandb'"):
        GRPOConfig(report_to="mlflow")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(ImportError,
                       match=r"report_to names \['wandb'\], which are not installed: pip install wandb"):
        GRPOConfig(report_to=["wandb"])
    assert "wandb" not in GRPOConfig(report_to="all").report_to


def test_model_init_kwargs_load_a_folder_in_bfloat16_where_a_float32_lora_adapter_trains(tmp_path):
    """The small-GPU setup: a 16-bit base model (model_init_kwargs, TRL's name; default: float32, whatever the
    folder holds) and LoRA adapters in float32 (peft's default)."""
    tokenizer, folder = make_tokenizer(), str(tmp_path / "tiny")
    make_model(tokenizer).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert make_trainer(tmp_path, model=folder).model.dtype == torch.float32
    trainer = make_trainer(tmp_path, model=folder, model_init_kwargs='{"dtype": "bfloat16"}',  # a flag's JSON
                           peft_config=lora(), beta=0.1, num_iterations=2, max_steps=3)
    frozen = {p.dtype for p in trainer.model.parameters() if not p.requires_grad}
    adapter = [p for p in trainer.model.parameters() if p.requires_grad]
    assert frozen == {torch.bfloat16} and {p.dtype for p in adapter} == {torch.float32}
    before = [p.detach().clone() for p in adapter]
    trainer.train()
    assert all(not torch.equal(a, b) for a, b in zip(before, adapter))


def test_a_checkpoint_of_another_model_or_kind_is_refused_before_anything_loads(tmp_path):
    """Weights of other names or shapes, read from the safetensors header (load_state_dict would copy the
    tensors that fit before it raised); a folder that lacks a checkpoint's files is named with them;
    resume_from_checkpoint=True where output_dir has none."""
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    tokenizer = make_tokenizer()
    config = make_model(tokenizer).config.to_dict()
    wider = LlamaForCausalLM(LlamaConfig(**{**config, "intermediate_size": 128}))
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(ValueError, match=r"model.safetensors in .* is another model's: .*mlp"):
        make_trainer(tmp_path, model=wider, tokenizer=tokenizer, output_dir=str(tmp_path / "c")).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert all(torch.equal(v, before[k]) for k, v in wider.state_dict().items())
    with pytest.raises(ValueError, match=r"no checkpoint of this kind of run .* lacks \['trainer_state"):
        make_trainer(tmp_path, output_dir=str(tmp_path / "d")).train(resume_from_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="holds no checkpoint"):
        make_trainer(tmp_path, output_dir=str(tmp_path / "e")).train(resume_from_checkpoint=True)


def test_inputs_beyond_the_cores_checks_are_named_at_construction(tmp_path):
    with pytest.raises(TypeError, match="train_dataset must be a datasets.Dataset"):
        make_trainer(tmp_path, dataset=Dataset.from_dict({"prompt": PROMPTS}).to_iterable_dataset())
    with pytest.raises(ValueError, match="reward_weights has 2 weights for 1 reward functions"):
        make_trainer(tmp_path, reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"reward_weights=\[nan\] must be finite"):
        make_trainer(tmp_path, reward_weights=[math.nan])
    for rows, match in [([{"prompt": "hello"}, {"prompt": None}], "train_dataset row 1: its prompt None"),
                        ([{"prompt": "  "}], "row 0: its prompt '  ' must be a non-empty string"),
                        ([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "hi"}]}], "mixes text"),
                        ([{"prompt": [{"role": "user", "text": "hi"}]}], "'role', 'content'"),
                        ([{"prompt": "hello", "completions": 1}], r"columns \['completions'\] take names")]:
        with pytest.raises(ValueError, match=match):
            make_trainer(tmp_path, dataset=rows)
    with pytest.raises(TypeError, match="reward models .* are not supported"):
        make_trainer(tmp_path, reward_funcs=torch.nn.Linear(2, 1))
    tokenizer = make_tokenizer()
    model = make_model(tokenizer)
    tokenizer.add_tokens(["[NEW]"])
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens, the model.s embeddings \d+: after"):
        make_trainer(tmp_path, tokenizer=tokenizer, model=model)


def test_the_config_checks_each_fields_type_and_a_path_or_numpy_number_still_resumes(tmp_path):
    """A "false" string is truthy, 1.5 steps no count: refused by type. A Path output_dir and numpy numbers
    (numpy.logspace's learning rates) become plain values, so the checkpoint's JSON holds them and resumes."""
    for field, value in [("overwrite_output_dir", "false"), ("bf16", "false"), ("max_steps", 1.5),
                         ("num_generations", 4.0), ("temperature", math.inf)]:
        with pytest.raises((TypeError, ValueError), match=field):
            GRPOConfig(**{field: value})
    numpy = pytest.importorskip("numpy")
    make_trainer(tmp_path, output_dir=tmp_path / "out", learning_rate=numpy.float64(1e-2),
                 max_steps=numpy.int64(2), save_steps=1).train()
    trainer = make_trainer(tmp_path, output_dir=tmp_path / "out", max_steps=3)
    trainer.train(resume_from_checkpoint=True)
    assert trainer.step == 3


async def async_short_is_good(completion_ids, **kwargs):
    return short_is_good(completion_ids)


def test_an_async_reward_function_is_awaited_as_in_trl(tmp_path):
    trainer = make_trainer(tmp_path, reward_funcs=async_short_is_good, max_steps=1).train()
    assert trainer.step == 1 and "rewards/async_short_is_good/mean" in metrics_of(tmp_path / "out")[0]


def test_a_resume_starts_a_new_timeline_and_sets_the_old_ones_later_checkpoints_aside(tmp_path):
    """Resume from checkpoint-2 of a run that reached checkpoint-4, with another rate, as checkpoints.md
    allows: checkpoint-3 and 4 belong to the abandoned timeline. They are set aside (never picked by
    resume=True, never counted by save_total_limit), and the new run's checkpoint-3 is its own."""
    make_trainer(tmp_path, max_steps=4, save_steps=1).train()
    out = tmp_path / "out"
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=1, learning_rate=5e-3, save_total_limit=2)
    with pytest.raises(KeyboardInterrupt):
        interrupted_after_step(3, trainer).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert checkpoints(out) == ["checkpoint-2", "checkpoint-3"]
    assert {"checkpoint-3.abandoned", "checkpoint-4.abandoned"} <= set(os.listdir(out))
    resumed = make_trainer(tmp_path, max_steps=4, save_steps=1, learning_rate=5e-3)
    resumed.train(resume_from_checkpoint=True)  # the new timeline's checkpoint-3, not the old 4
    assert [r["step"] for r in metrics_of(out)] == [1, 2, 3, 4]


def test_a_resume_writes_only_into_its_checkpoints_own_folder_or_an_empty_one(tmp_path):
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    make_trainer(tmp_path, max_steps=1, output_dir=str(tmp_path / "other")).train()
    with pytest.raises(ValueError, match="output_dir .*other.* holds"):
        make_trainer(tmp_path, max_steps=2, output_dir=str(tmp_path / "other")).train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    os.rename(tmp_path / "out" / "checkpoint-2", tmp_path / "out" / "checkpoint-2.tmp")
    with pytest.raises(ValueError, match="is an unfinished checkpoint"):
        unfinished = str(tmp_path / "out" / "checkpoint-2.tmp")
        make_trainer(tmp_path, max_steps=2).train(resume_from_checkpoint=unfinished)
    assert (tmp_path / "out" / "checkpoint-2.tmp").exists()  # kept: the user named it


# ---- Inputs: models (loaded already, a frozen adapter, a missing folder, tied LoRA, no head), rewards -----
def test_model_init_kwargs_given_with_a_loaded_model_warn_that_they_are_ignored_as_in_trl(tmp_path):
    with pytest.warns(UserWarning, match="model_init_kwargs are ignored: the model is loaded already"):
        make_trainer(tmp_path, model_init_kwargs={"dtype": "bfloat16"})


def test_a_peft_model_loaded_without_is_trainable_is_refused_with_that_advice(tmp_path):
    """peft loads a saved adapter frozen unless asked: such a model has nothing to train."""
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()
    peft.get_peft_model(make_model(tokenizer), lora()).save_pretrained(tmp_path / "adapter")
    frozen = peft.PeftModel.from_pretrained(make_model(tokenizer), tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"no trainable weights .* is_trainable=True"):
        make_trainer(tmp_path, model=frozen, tokenizer=tokenizer)


def test_a_missing_model_folder_is_named_as_a_folder_not_as_a_malformed_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"model './no-such-model' is a local path.* does not exist"):
        make_trainer(tmp_path, model="./no-such-model")


def test_a_lora_adapter_on_tied_embeddings_merges_into_the_trained_policy_by_reference_mds_recipe(tmp_path):
    """An adapter on embed_tokens changes the input embedding alone; the LM head that shares its weight reads
    the base weight. A plain merge_and_unload moves the head too; docs/reference.md's recipe does not."""
    peft = pytest.importorskip("peft")
    tokenizer = make_tokenizer()

    def tied_base():
        config = make_model(tokenizer).config
        config.tie_word_embeddings = True
        torch.manual_seed(0)
        return LlamaForCausalLM(config)

    trainer = make_trainer(tmp_path, model=tied_base(), tokenizer=tokenizer, learning_rate=0.1,
                           peft_config=lora(target_modules=["embed_tokens", "q_proj"])).train()
    ids = torch.tensor([list(range(2, 12))])
    trained = trainer.model(input_ids=ids).logits.detach()
    plain = peft.PeftModel.from_pretrained(tied_base(), tmp_path / "out").merge_and_unload()
    assert (plain(input_ids=ids).logits - trained).abs().max() > 1e-2
    with open(os.path.join(HERE, "..", "docs", "reference.md")) as f:
        blocks = [b.split("```")[0] for b in f.read().split("```python\n")[1:]]
    recipe = next(b for b in blocks if "merge_and_unload" in b)
    scope = {"PeftModel": peft.PeftModel, "torch": torch, "base": tied_base(), "output_dir": tmp_path / "out"}
    exec(textwrap.dedent(recipe), scope)
    scope["merged"].save_pretrained(tmp_path / "merged")
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged")
    torch.testing.assert_close(merged(input_ids=ids).logits, trained, rtol=0, atol=1e-5)


def test_a_model_without_an_lm_head_is_named_at_construction(tmp_path):
    with pytest.raises(TypeError, match="LlamaModel has no LM head .* AutoModelForCausalLM"):
        make_trainer(tmp_path, model=make_model(make_tokenizer()).model)


def test_an_empty_output_dir_is_named_when_the_config_is_made():
    with pytest.raises(ValueError, match="output_dir='' names no folder"):
        GRPOConfig(output_dir="")


def test_a_reward_function_returning_a_dict_is_refused_not_read_by_its_keys(tmp_path):
    def by_index(completions, **kwargs):
        return {i: 1.0 for i in range(len(completions))}  # iterated, a dict gives 0, 1, 2...: its keys
    with pytest.raises(RuntimeError, match="'by_index' failed: TypeError: it returned a dict: return a list"):
        make_trainer(tmp_path, reward_funcs=by_index, max_steps=1).train()


def test_a_reward_model_is_refused_by_its_class_name_not_its_repr(tmp_path):
    classifier = LlamaForSequenceClassification(make_model(make_tokenizer()).config)
    with pytest.raises(TypeError, match=r"^reward models \['LlamaForSequenceClassification'\] are not sup"):
        make_trainer(tmp_path, reward_funcs=classifier)


# ---- A finished step keeps its row and its checkpoint, whatever cuts its end ------------------------------
# A step is finished once its weight update is done. Its evaluation, log() and trackers are not held: a signal
# cuts them at once, and a failure or a signal there still writes the step's metrics row and its checkpoint.
A_60_S_LOG_AT_STEP_3 = """
import time
from pathlib import Path
import test_grpo_long_runs as t
trainer = t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100, num_iterations=2)
def slow_log(row):  # a log() override whose write takes 60 s at step 3: a tracker's server that hangs
    if row["step"] == 3:
        open({flag!r}, "w").close()
        time.sleep(60)
    t.GRPOTrainer.log(trainer, row)
trainer.log = slow_log
trainer.train()
"""


@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_during_a_60_s_log_exits_within_seconds_with_the_steps_row_and_checkpoint(tmp_path, child_at,
                                                                                          signum, code):
    """SIGTERM or Ctrl-C while log() writes step 3's row (inside a μ = 2 generation batch): the process exits
    within seconds, and step 3, finished with its update, has its row in metrics.jsonl and its checkpoint.
    Both are those of a run that never stopped, which the resumed run ends as."""
    flag = tmp_path / "logging"
    script = A_60_S_LOG_AT_STEP_3.format(flag=str(flag), tmp=str(tmp_path))
    exit_code, seconds = run_until(child_at, script, flag, signum)
    assert exit_code == code and seconds < 20, (exit_code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-3"]
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3]
    assert_resumes_like_a_run_that_never_stopped(tmp_path, num_iterations=2)



A_REWARD_WAITING_FOR_ITS_THREADS = """
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import test_grpo_long_runs as t
calls = []
def judge(completion):  # a grader's request that takes 60 s
    open({flag!r}, "w").close()
    time.sleep(60)
    return 0.0
def pooled(completions, completion_ids, **kwargs):  # step 3's rewards come from a thread pool
    calls.append(1)
    if len(calls) == 3:
        with ThreadPoolExecutor(2) as pool:  # leaving the block waits for the threads, signal or not
            return list(pool.map(judge, completions))
    return t.short_is_good(completion_ids)
t.make_trainer(Path({tmp!r}), pooled, max_steps=4, save_steps=100).train()
"""


def test_sigterm_writes_the_checkpoint_at_once_even_if_user_code_then_waits_for_its_threads(tmp_path,
                                                                                           child_at):
    """A reward function in a `with ThreadPoolExecutor` block: the signal's exception waits in the block's
    end for the 60 s threads, and a scheduler's SIGKILL comes before them. checkpoint-2 is written at once."""
    flag = tmp_path / "judging"
    script = A_REWARD_WAITING_FOR_ITS_THREADS.format(flag=str(flag), tmp=str(tmp_path))
    with child_at(flag, script) as process:
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not checkpoints(tmp_path / "out"):
            time.sleep(0.2)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]



A_REWARD_THAT_SWALLOWS_THE_SIGNAL = """
import time
from pathlib import Path
import test_grpo_long_runs as t
calls = []
def grader(completion_ids, **kwargs):  # step 3's call: a bare except turns the signal's exit into a 0 reward
    calls.append(1)
    if len(calls) == 3:
        try:
            open({flag!r}, "w").close()
            time.sleep(60)
        except:
            return [0.0] * len(completion_ids)
    return t.short_is_good(completion_ids)
t.make_trainer(Path({tmp!r}), grader, max_steps=4, save_steps=100).train()
"""


def test_a_reward_that_swallows_the_signal_does_not_make_its_step_train(tmp_path, child_at):
    """The signal wins over a result made after it: step 3 never trains on the fake 0 rewards."""
    flag = tmp_path / "grading"
    script = A_REWARD_THAT_SWALLOWS_THE_SIGNAL.format(flag=str(flag), tmp=str(tmp_path))
    code, seconds = run_until(child_at, script, flag, signal.SIGTERM)
    assert code == 143 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2]


def failing_at_step_2(trainer, part, monkeypatch):
    """The trainer, with its evaluation, its log() or its tracker raising at step 2, after the update."""
    def fail(original):
        def wrapped(*args):
            if trainer.step == 2:
                raise ConnectionError(f"the {part} failed")
            return original(*args)
        return wrapped
    if part == "evaluation":
        trainer.evaluate = fail(trainer.evaluate)
    if part == "log":
        trainer.log = fail(trainer.log)
    if part == "tracker":
        monkeypatch.setattr(lr.Tracker, "log", fail(lr.Tracker.log))
    return trainer


@pytest.mark.parametrize("part", ["evaluation", "log", "tracker"])
def test_a_step_whose_evaluation_log_or_tracker_fails_keeps_its_row_and_checkpoint(tmp_path, part,
                                                                                    monkeypatch):
    """Step 2's update is done when its evaluation, log() or tracker fails: its row (without the evaluation's
    metrics, which never came) is in metrics.jsonl and checkpoint-2 holds it; the resumed run goes on."""
    options = dict(max_steps=4, save_steps=100, eval_strategy="steps", eval_steps=2, report_to="tensorboard",
                   eval_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS}))
    with pytest.raises(ConnectionError, match=f"the {part} failed"):
        failing_at_step_2(make_trainer(tmp_path, **options), part, monkeypatch).train()
    assert checkpoints(tmp_path / "out") == ["checkpoint-2"]
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2]
    monkeypatch.undo()
    make_trainer(tmp_path, **options).train(resume_from_checkpoint=True)
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3, 4]


RANK_0_FAILS_ALONE = """
import os, sys
from pathlib import Path
os.environ.update(RANK=sys.argv[1], LOCAL_RANK=sys.argv[1], WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="{port}")
import test_grpo_long_runs as t
trainer = t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100, num_iterations=2)
def failing(function, step):  # rank 0's log() (its trackers') or final save fails, once at `step`
    def wrapped(*args):
        if trainer.rank == 0 and trainer.step == step:
            open({flag!r}, "w").close()
            raise ConnectionError("rank 0 failed alone")
        return function(*args)
    return wrapped
if {part!r} == "log":
    trainer.log = failing(trainer.log, 3)
else:
    trainer.save_final_model = failing(trainer.save_final_model, 4)
trainer.train()
t.torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("part,step", [("log", 3), ("final save", 4)])
def test_a_failure_in_code_only_rank_0_runs_ends_every_rank_quickly_with_a_checkpoint(tmp_path, part, step):
    """Two processes; rank 0's log() fails at step 3, inside a μ = 2 generation batch (rank 1 waits for it
    in a collective, and checkpoint-3 needs rank 1's part of the batch), or its final save fails after
    rank 1 has returned. Every rank ends within seconds, and the step's checkpoint holds both ranks' files."""
    flag = tmp_path / "failed"
    script = RANK_0_FAILS_ALONE.format(port=free_port(), tmp=str(tmp_path), part=part, flag=str(flag))
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(rank)], env=CHILD_ENV) for rank in (0, 1)]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not flag.exists():
        time.sleep(0.1)
    failed = time.monotonic()
    while time.monotonic() < failed + 60 and None in [p.poll() for p in ranks]:
        time.sleep(0.1)
    seconds, codes = time.monotonic() - failed, [p.poll() for p in ranks]
    for p in ranks:
        p.kill()
        p.wait()
    assert codes[0] == 1 and codes[1] is not None and seconds < 20, (codes, seconds)
    assert checkpoints(tmp_path / "out") == [f"checkpoint-{step}"]
    files = sorted(os.listdir(tmp_path / "out" / f"checkpoint-{step}"))
    assert "rank_0.pt" in files and "rank_1.pt" in files
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == list(range(1, step + 1))


TORCHRUN_SLOW_LOG = """
import time
from pathlib import Path
import test_grpo_long_runs as t
trainer = t.make_trainer(Path({tmp!r}), max_steps=4, save_steps=100, per_device_train_batch_size=4,
                         gradient_accumulation_steps=1, num_iterations=2)
def slow_log(row):  # rank 0's log of step 3 takes 60 s; rank 1 waits for it in a collective
    if trainer.rank == 0 and row["step"] == 3:
        open({flag!r}, "w").close()
        time.sleep(60)
    t.GRPOTrainer.log(trainer, row)
trainer.log = slow_log
trainer.train()
"""


def test_sigterm_to_torchrun_during_rank_0s_60_s_log_stops_every_rank_with_the_steps_checkpoint(tmp_path,
                                                                                              child_at):
    """torchrun forwards SIGTERM to both processes: rank 0 is in a 60 s log() of step 3, rank 1 waits for it
    in a collective. Both exit within seconds; step 3's row is written and checkpoint-3 holds both ranks'
    parts of the generation batch."""
    worker, flag = tmp_path / "worker.py", tmp_path / "logging"
    worker.write_text(TORCHRUN_SLOW_LOG.format(flag=str(flag), tmp=str(tmp_path)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(worker)]
    code, seconds = run_until(child_at, None, flag, signal.SIGTERM, command=command)
    assert code != 0 and seconds < 20, (code, seconds)
    assert checkpoints(tmp_path / "out") == ["checkpoint-3"]
    files = sorted(os.listdir(tmp_path / "out" / "checkpoint-3"))
    assert "rank_0.pt" in files and "rank_1.pt" in files
    assert [r["step"] for r in metrics_of(tmp_path / "out")] == [1, 2, 3]


# ---- Resume checks that stay cheap, and what user code may log -------------------------------------------
def test_a_checkpoint_that_trains_other_tensors_is_refused_by_name_before_anything_loads(tmp_path):
    """Same names and shapes in model.safetensors, but another set of trained tensors: AdamW's state would be
    matched by position (fused AdamW then reads past a tensor's end). The tensors are named, nothing loads."""
    def frozen(*modules):  # the tiny model, with these modules' weights frozen
        model = make_model(make_tokenizer())
        for name in modules:
            model.get_submodule(name).requires_grad_(False)
        return model
    make_trainer(tmp_path, model=frozen("model.embed_tokens"), max_steps=1).train()
    for modules in (["lm_head"], ["model.embed_tokens", "model.norm"]):  # as many trained tensors, or fewer
        other = make_trainer(tmp_path, model=frozen(*modules), max_steps=2)
        before = {k: v.clone() for k, v in other.model.state_dict().items()}
        with pytest.raises(ValueError, match=r"optimizer.pt in .* trains other tensors: .*(lm_head|norm)"):
            other.train(resume_from_checkpoint=True)
        assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())


def test_a_checkpoint_of_other_training_prompts_is_refused_before_anything_loads(tmp_path):
    """Same batch shape, other prompts: the resume would go on in another run's prompt order."""
    make_trainer(tmp_path, max_steps=2, save_steps=1).train()
    reversed_prompts = Dataset.from_dict({"prompt": PROMPTS[::-1]})
    other = make_trainer(tmp_path, dataset=reversed_prompts, max_steps=3)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ValueError, match=r"checkpoint-1' was written with other training prompts .*\[8, "):
        other.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert all(torch.equal(v, before[k]) for k, v in other.model.state_dict().items())


def test_reward_functions_with_the_same_name_keep_a_metric_each(tmp_path):
    """Two lambdas (or two closures of one factory) are both named "<lambda>": numbered, not merged."""
    ones, twos = ((lambda completions, **kw: [1.0] * len(completions)),
                  (lambda completions, **kw: [2.0] * len(completions)))
    _, metrics = make_trainer(tmp_path, reward_funcs=[ones, twos]).generate_and_score(0)
    assert ((metrics["rewards/<lambda>_1/mean"], metrics["rewards/<lambda>_2/mean"], metrics["reward"])
            == (1.0, 2.0, 3.0))


def test_a_batch_cached_with_beta_0_gets_pi_refs_log_probs_when_resumed_with_beta_above_0(tmp_path):
    """checkpoint-3 falls inside a μ = 2 generation batch cached with β = 0, so without π_ref's log-probs.
    Resumed with β = 0.04 (allowed: β does not change the batch shape), they are computed from π_ref, which
    never changes: the step trains with the KL term as if the batch had cached them."""
    trainer = make_trainer(tmp_path, max_steps=4, save_steps=100, num_iterations=2)
    with pytest.raises(KeyboardInterrupt):
        interrupted_after_step(3, trainer).train()
    make_trainer(tmp_path, max_steps=4, num_iterations=2, beta=0.04).train(resume_from_checkpoint=True)
    rows = metrics_of(tmp_path / "out")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[3]["kl"] >= 0 and "kl" not in rows[2]


def test_a_row_that_user_code_logs_is_logged_at_the_current_step_and_never_breaks_a_resume(tmp_path):
    """HF's habit: trainer.log({...}) from user code, here a reward function. The row gets the current step,
    as in HF's Trainer, for metrics.jsonl and the trackers; a resume keeps the rows up to its step."""
    holder = []
    def noting_reward(completion_ids, **kwargs):
        holder[0].log({"note": 1.0})
        return short_is_good(completion_ids)
    holder.append(make_trainer(tmp_path, noting_reward, max_steps=2, save_steps=1, report_to="tensorboard"))
    holder[0].train()
    holder[0] = make_trainer(tmp_path, noting_reward, max_steps=3, report_to="tensorboard")
    holder[0].train(resume_from_checkpoint=True)
    steps = [(r["step"], "note" in r) for r in metrics_of(tmp_path / "out")]
    assert steps == [(0, True), (1, False), (1, True), (2, False), (2, True), (3, False)]


# ---- TensorBoard: one history per output_dir ------------------------------------------------------------
def logged_steps(out, tag="loss"):
    """The steps at which TensorBoard shows `tag`, over every event folder in out/runs."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    steps = []
    for run in sorted((out / "runs").iterdir()):
        events = event_accumulator.EventAccumulator(str(run), size_guidance={"scalars": 0})
        events.Reload()
        steps += [e.step for e in events.Scalars(tag)]
    return steps


def test_a_resume_shows_each_step_once_in_tensorboard(tmp_path):
    """A resume from checkpoint-2 of a 4-step run goes on in the run's event folder, with the steps after 2
    purged: TensorBoard shows the new timeline's steps 3 and 4, not the abandoned ones as well."""
    make_trainer(tmp_path, max_steps=4, save_steps=2, report_to="tensorboard").train()
    time.sleep(1.1)  # Event files sort by the second they were made in, as two real runs' do.
    make_trainer(tmp_path, max_steps=4, report_to="tensorboard", learning_rate=5e-3).train(
        resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert logged_steps(tmp_path / "out") == [1, 2, 3, 4]


def test_a_run_that_fails_before_its_first_row_leaves_no_file_so_it_can_be_run_again(tmp_path):
    """A failure in step 1 leaves no checkpoint to resume; TensorBoard's event folder is made at the first
    row, so none is left either, and the same run started again is not refused."""
    def down(completions, **kwargs):
        raise ConnectionError("the grader is down")
    with pytest.raises(RuntimeError, match="the grader is down"):
        make_trainer(tmp_path, down, report_to="tensorboard").train()
    assert os.listdir(tmp_path / "out") == []
    make_trainer(tmp_path, report_to="tensorboard").train()
    assert logged_steps(tmp_path / "out") == [1, 2]


def test_a_damaged_checkpoint_is_named_and_resume_true_falls_back_to_the_one_before(tmp_path, capsys):
    """A file cut short (a full disk) or damaged is named with its path before anything loads. resume=True
    says so and resumes from the newest checkpoint that reads whole; the damaged ones are set aside."""
    make_trainer(tmp_path, max_steps=3, save_steps=1).train()
    out = tmp_path / "out"
    (out / "checkpoint-3" / "trainer_state.json").write_text('{"step": 3, "wor')
    weights = out / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"trainer_state.json in .*checkpoint-3.* is damaged: JSONDecode"):
        make_trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    make_trainer(tmp_path, max_steps=4).train(resume_from_checkpoint=True)
    said = capsys.readouterr().out
    assert "checkpoint-3' is damaged" in said and "model.safetensors in" in said
    assert [r["step"] for r in metrics_of(out)] == [1, 2, 3, 4]
    assert {"checkpoint-2.abandoned", "checkpoint-3.abandoned"} <= set(os.listdir(out))


def test_an_eval_set_that_does_not_split_over_the_processes_is_refused_by_evaluate_too(tmp_path):
    """trainer.evaluate(), called by a user, checks what train() checks: uneven shares would leave one
    process waiting in a collective that the other never joins."""
    trainer = make_trainer(tmp_path, eval_dataset=Dataset.from_dict({"prompt": EVAL_PROMPTS[:3]}))
    trainer.world_size = 2  # As under torchrun; the check comes before any collective.
    with pytest.raises(ValueError, match="3 prompts do not split evenly over 2 processes"):
        trainer.evaluate()


def test_a_checkpoint_write_that_fails_as_on_a_full_disk_says_so_with_its_folder(tmp_path, monkeypatch):
    """torch.save reports a full disk as "basic_ios::clear: iostream error", which never says "disk"."""
    save = torch.save
    def full_disk(obj, path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise RuntimeError("basic_ios::clear: iostream error")
        save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"writing .*checkpoint-1.tmp failed \(a full disk\?\)"):
        make_trainer(tmp_path, save_steps=1).train()
