"""Where the memory goes: peak resident memory (RSS) by phase of an optimizer step, on Linux.

    python -m experiments.memory_phases [STEPS] [train_tldr.py flags ...]

Runs train_tldr.py's training on the benchmark's μ = 1, β = 0 configuration (experiments/benchmark.py's shape,
completions ending at EOS) for STEPS optimizer steps (default
3; extra flags are passed on, e.g. `--gradient_checkpointing True`), with
- a thread that reads the process's RSS every 2 ms and keeps the highest value of each phase
  (generate, old/ref log-probs, forward, backward, optimizer; "between" is everything else);
- the bytes of the tensors that autograd saves for backward in each training forward (the
  activations of one micro-batch; weights excluded, they exist anyway);
- the memory that glibc's allocator holds free in its heap at the end of each phase (`mallinfo2`),
  i.e. freed by torch, most of it still resident (glibc gives back only the top of its heap), where
  the C library is glibc.
It prints one line per step, then the floor that no activation is part of: the imports' RSS before
the model is loaded, and the bytes of weights, gradients and AdamW's two moments."""
import functools
import sys
import threading
import time

import torch

import grpo_long_runs
import grpo_multistep
import train_tldr
from experiments import benchmark
from experiments.measure_memory import in_phase, mallinfo, rss

GIB = 2**30
phase = ["between"]
peak, heap_free, saved, weight_bytes = {}, {}, [], [0]


def sample():  # the highest RSS seen in each phase
    while True:
        label = phase[0]
        peak[label] = max(peak.get(label, 0), rss())
        time.sleep(0.002)


mallinfo2 = mallinfo()  # glibc's (2.33+), else None: no heap figure


def record_heap_free(label):  # at the end of a phase: what glibc holds free in its heap
    heap_free[label] = max(heap_free.get(label, 0), mallinfo2().fordblks)


def count_saved(f):
    """per_token_logps with a count of the bytes autograd saves for backward (each storage once)."""
    @functools.wraps(f)
    def wrapped(model, *args, **kwargs):
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved as views too
        storages = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = f(model, *args, **kwargs)
        if torch.is_grad_enabled():
            saved.append(sum(storages.values()))
        return out
    return wrapped


class Trainer(train_tldr.Trainer):
    def log(self, metrics):
        super().log(metrics)
        phases = " ".join(f"{k} {v / GIB:.2f}" for k, v in peak.items())
        line = f"step {metrics['step']}: peak RSS GiB by phase: {phases}; activations of a micro-batch " \
               f"{max(saved, default=0) / GIB:.3f} GiB"
        if heap_free:
            line += "; glibc free heap GiB: " + " ".join(f"{k} {v / GIB:.2f}" for k, v in heap_free.items())
        print(line, flush=True)
        for measure in (peak, heap_free, saved):  # each step on its own
            measure.clear()
        weight_bytes[0] = sum(p.numel() * p.element_size() for p in self.model.parameters())


def main(argv):
    steps = int(argv[0]) if argv and argv[0].isdigit() else 3
    flags = argv[1:] if argv and argv[0].isdigit() else argv
    print(f"RSS of the imports, before the model: {rss() / GIB:.2f} GiB")
    grpo_long_runs.per_token_logps = count_saved(grpo_long_runs.per_token_logps)  # the pass the demo runs
    on_end = record_heap_free if mallinfo2 else None
    gm = grpo_multistep
    for owner, name, label in [(gm, "generate_completions", "generate"), (gm, "cached_logps", "logps"),
                               (grpo_long_runs, "per_token_logps", "forward"), (torch.Tensor, "backward", "backward"),
                               (torch.optim.AdamW, "step", "optimizer")]:
        in_phase(phase, owner, name, label, on_end)
    threading.Thread(target=sample, daemon=True).start()
    run = {"num_iterations": 1, "beta": 0.0, "logging_steps": 1, "max_steps": steps,
           "output_dir": "/tmp/grpo-memory"}
    config, opts = benchmark.parse_args([*(f"--{k}={v}" for k, v in run.items()), *flags])  # its shape first
    opts.script, opts.argv = "-mexperiments.memory_phases", argv  # python -mexperiments.memory_phases: -m
    train_tldr.run_all(config, [config], config.output_dir, opts, Trainer, report=lambda *args: None)
    w = weight_bytes[0] / GIB
    print(f"weights {w:.2f} GiB, gradients {w:.2f} GiB, AdamW's two moments {2 * w:.2f} GiB: {4 * w:.2f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
