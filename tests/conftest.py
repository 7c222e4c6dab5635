"""Fixtures that more than one test file here uses."""
import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import train_tldr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1",  # a child imports the repository's modules and tests'
             "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), ROOT])}


@contextlib.contextmanager
def child(flag, script=None, command=None):
    """A child process running `script` (or `command`), once it has made `flag`; killed at the block's end."""
    process = subprocess.Popen(command or [sys.executable, "-c", script], env=CHILD_ENV)
    try:
        for _ in range(1200):
            if flag.exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        assert flag.exists(), f"the child never reached its flag (exit status {process.poll()})"
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def child_at():
    """child_at(flag, script=None, command=None): a context manager around a child process, entered once the
    child has made `flag` (it stands for "the child has reached that point")."""
    return child


@pytest.fixture
def child_env():
    return CHILD_ENV


@pytest.fixture
def one_thread(monkeypatch):
    """A tiny model gains nothing from a second thread, and on a shared 2-core machine each of its many
    small ops would wait for that thread to be scheduled: one thread is several times faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # The benchmark's child processes read it.
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def start_as_recorded():
    """check(folder, task): the starting model in `folder` scores on its task's held-out prompts, sampled and
    greedy, what `make` recorded in its start.json, within 2 points; it returns (model, the record)."""
    # Imported here, so that only the testbeds' tests load the testbeds' machinery.
    from experiments import addition

    def check(folder, task):
        model, tokenizer = addition.load_start(folder)
        with open(os.path.join(folder, "start.json")) as f:
            recorded = json.load(f)
        scores = addition.held_out_scores(model, tokenizer, task.split()["held_out"], task)
        assert abs(scores["sampled"] - recorded["sampled"]) <= 0.02
        assert abs(scores["greedy"] - recorded["greedy"]) <= 0.02
        return model, recorded
    return check


class TinyDemo:
    """The tiny model's folder and its prompts file; the demo's flags for a run of a few seconds on them, and
    the metrics that such a run logs."""

    def __init__(self, model, data):
        self.model = model
        self.data = data

    def args(self, out, *extra):
        """A run of a few seconds: 2 prompts × 4 generations of 8 tokens per optimizer step."""
        return ["--preset", "cpu", "--model", self.model, "--dataset", self.data, "--output_dir", str(out),
                "--max_steps", "2", "--num_generations", "4", "--per_device_train_batch_size", "4",
                "--gradient_accumulation_steps", "2", "--max_completion_length", "8",
                "--max_prompt_length", "128", "--logging_steps", "1", "--log_completions", "False", *extra]

    @staticmethod
    def metrics(folder):
        """The rows of the run's metrics.jsonl in `folder`, in order."""
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A TinyDemo: a tiny random Llama and a BPE tokenizer trained on the demo's embedded posts, saved as a
    model folder, and 16 plain-text prompts as a JSONL file."""
    with open(train_tldr.POSTS) as f:
        posts = [json.loads(line) for line in f]
    corpus = [f"SUBREDDIT: r/{p['subreddit']}\nTITLE: {p['title']}\nPOST: {p['post']}\nTL;DR: "
              f"{p['title'].lower()}" for p in posts]
    root = tmp_path_factory.mktemp("tiny")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
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
    data.write_text("".join(json.dumps({"prompt": c.split("TL;DR:")[0] + "TL;DR:"}) + "\n"
                            for c in corpus[:16]))
    return TinyDemo(str(root / "model"), str(data))
