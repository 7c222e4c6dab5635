"""Tests of tldr/memory.py, train_tldr.py's memory model: known answers (parameter counts against the models
themselves, the saved activations against autograd's own count, the terms that a switch adds or removes), one
optimizer step of a small random model in a fresh process, its peak RSS against the estimate, and
measure_memory's --fit. About 30 s on 2 cores (the steps' processes: 25 s of it)."""
import math
import os

import pytest
import torch
import transformers

import grpo_long_runs as gm
from experiments import measure_memory
from tldr.memory import QWEN25_05B, activation_bytes, estimate_step_memory, lora_param_count, param_count

SMALL = dict(model_type="llama", hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True,
             max_position_embeddings=512)
SHAPE = dict(num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=2,
             max_prompt_length=64, max_completion_length=64, beta=0.04, loss_type="bnpo", temperature=0.9)


def grpo_config(**overrides):
    return gm.GRPOConfig(output_dir=os.path.join("/tmp", "unused"), **{**SHAPE, **overrides})


def build(config):  # a model on the meta device: its parameters' shapes, no memory, no time
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


CONFIGS = {"qwen2.5-0.5b": lambda: QWEN25_05B,
           "smollm2-135m": lambda: measure_memory.model_config("smollm2-135m"),  # (converted once, at need)
           "llama-untied-biases": lambda: {**SMALL, "tie_word_embeddings": False, "attention_bias": True,
                                           "mlp_bias": True},
           "qwen2-untied": lambda: {**SMALL, "model_type": "qwen2", "tie_word_embeddings": False}}


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_count_is_the_models_own(name):
    config = transformers.AutoConfig.for_model(**CONFIGS[name]())
    assert param_count(config) == sum(p.numel() for p in build(config).parameters())  # tied: counted once


def test_lora_parameter_count_is_peft_s():
    peft = pytest.importorskip("peft")
    config = transformers.AutoConfig.for_model(**SMALL)
    model = peft.get_peft_model(build(config), peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj",
                                                                                      "v_proj", "o_proj"]))
    assert lora_param_count(config, 16) == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_are_what_autograd_saves(checkpointing):
    """The activation term against the bytes of the tensors that autograd saves in per_token_logps (each
    storage once, weights excluded), forward only (with checkpointing: less the layer rebuilt in backward)."""
    config = transformers.AutoConfig.for_model(**{**SMALL, "vocab_size": 512})
    args = grpo_config(per_device_train_batch_size=4, max_prompt_length=24, max_completion_length=16,
                       gradient_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).train()
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    b, P, C = 4, 24, 16
    prompt = torch.randint(2, 512, (1, P)).repeat(b, 1)  # one prompt: b < G completions of it
    weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gm.per_token_logps(model, prompt, torch.ones(b, P, dtype=torch.long), torch.randint(2, 512, (b, C)),
                           torch.ones(b, C, dtype=torch.long), 1.0)
    H, I, heads, d = 256, 1024, 4, 64
    rebuilt = b * (P + C) * (8 * H + 4 * I) * 4 + 2 * b * heads * (P + C) * d * 4 if checkpointing else 0
    assert sum(saved.values()) == pytest.approx(activation_bytes(config, args, 4, P)[0] - rebuilt, rel=0.05)


def test_switches_add_and_remove_their_terms():
    config = transformers.AutoConfig.for_model(**SMALL)
    full = estimate_step_memory(config, grpo_config())
    assert full["reference"] == full["weights"] == 4 * param_count(config)  # beta > 0: a float32 copy
    assert estimate_step_memory(config, grpo_config(beta=0.0))["reference"] == 0
    lora = estimate_step_memory(config, grpo_config(), lora_params=lora_param_count(config),
                                base_dtype=torch.bfloat16)
    assert lora["reference"] == 0  # its π_ref: the adapter disabled
    assert lora["weights"] == 2 * param_count(config) + 4 * lora_param_count(config)
    assert lora["gradients"] == 4 * lora_param_count(config) == lora["adam_moments"] / 2
    checkpointed = estimate_step_memory(config, grpo_config(gradient_checkpointing=True))
    assert checkpointed["activations"] < full["activations"]
    assert checkpointed["peak"] < full["peak"]
    two = estimate_step_memory(config, grpo_config(), world_size=2)
    assert two["all_reduce"] == full["gradients"] and full["all_reduce"] == 0
    assert two["phase_all_reduce"] - full["phase_all_reduce"] == full["gradients"]
    assert estimate_step_memory(config, grpo_config(), device="cuda")["retention"] == 0
    first = estimate_step_memory(config, grpo_config(), first_step=True)
    assert first["peak"] < full["peak"]  # AdamW's moments come at the first step's end


def test_estimate_matches_the_peak_rss_of_one_step():
    """One optimizer step of a 16.5M-parameter Llama in a fresh process: its peak RSS against the estimate
    with the process's own baseline (its RSS before the model is built). Tolerances: 15 % of the peak, and
    20 % of what the step adds to the baseline (the part that the model predicts rather than measures; its
    glibc retention term, 134 MB of 620, is fitted to within ±40 %, runs vary by 3 %: measured −3 %, −8 %);
    and 10 % for malloc's own count of the bytes in use (mallinfo2), which the allocator's keeping of freed
    blocks does not move."""
    args = dict(SHAPE, learning_rate=1e-6)
    result = measure_memory.measure(SMALL, args, steps=1, timeout=300, env={"OMP_NUM_THREADS": "1"})
    config = transformers.AutoConfig.for_model(**SMALL)
    estimate = estimate_step_memory(config, grpo_config(), baseline=result["baseline"], first_step=True)
    assert result["params"] == param_count(config)
    step = result["peak"] - result["baseline"]
    assert step > result["baseline"] / 2, "the model too small to test anything but the baseline"
    assert estimate["peak"] == pytest.approx(result["peak"], rel=0.15), (estimate, result)
    assert estimate["peak"] - result["baseline"] == pytest.approx(step, rel=0.20), (estimate, result)
    if result["live"]:  # glibc: the bytes malloc handed out, against the estimate without retention
        kept = estimate_step_memory(config, grpo_config(), baseline=result["baseline"], first_step=True,
                                    device="none")["peak"] - result["baseline"] + result["baseline_live"]
        assert kept == pytest.approx(max(result["live"].values()), rel=0.10), (estimate, result)
    assert math.isfinite(result["seconds"])


def test_the_peak_is_the_childs_own_not_its_parents():
    """ru_maxrss survives exec: a measuring child of a large process would report the parent's RSS."""
    ballast = bytearray(1536 * 2**20)  # 1.5 GiB in the parent, touched: above the child's tiny step
    ballast[::4096] = b"x" * len(ballast[::4096])
    result = measure_memory.measure(SMALL, dict(SHAPE, learning_rate=1e-6, max_completion_length=8,
                                                per_device_train_batch_size=8, gradient_accumulation_steps=1),
                                    steps=1, timeout=300, env={"OMP_NUM_THREADS": "1"})
    del ballast
    assert result["peak"] < 1.2 * 2**30, result["peak"]  # its own: about 0.8 GiB


def test_on_a_gpu_the_report_puts_the_cuda_estimate_beside_max_memory_allocated(monkeypatch, capsys):
    """run.sh's memory lines on a GPU: the child's torch.cuda.max_memory_allocated beside the estimate for
    device="cuda" (no glibc retention, no baseline). The measurement is faked: no GPU here."""
    fake = {"baseline": 0.4 * 2**30, "peak": 3 * 2**30, "phases": {}, "live": {}, "baseline_live": 0,
            "params": 1, "seconds": 1.0, "torch": torch.__version__, "cuda_peak": 10 * 2**30}
    monkeypatch.setattr(measure_memory, "measure", lambda *args, **kwargs: fake)
    measure_memory.main(["qwen2.5-0.5b", "pr2899"])
    out = capsys.readouterr().out
    config = transformers.AutoConfig.for_model(**QWEN25_05B)
    cuda = estimate_step_memory(config, gm.GRPOConfig(**measure_memory.shapes("pr2899")), first_step=True,
                                device="cuda")
    assert f"max_memory_allocated 10.00 GiB; estimate {cuda['peak'] / 2**30:.2f} GiB" in out
    assert cuda["retention"] == 0 and cuda["baseline"] == 0


def test_the_fit_says_what_the_demo_would_run_with_so_much_free_memory(capsys):
    """--fit: train_tldr.py's choice at the pr2899 shapes, as the demo prints it on a GPU (here: figures)."""
    measure_memory.main(["qwen2.5-0.5b", "pr2899", "--bf16", "--fit", "7.5", "15.5"])
    out = capsys.readouterr().out
    assert "7.5 GiB free:" in out and "GPU: running LoRA (rank 16) on bfloat16 weights" in out
    assert "15.5 GiB free:" in out and "GPU: running as given" in out
