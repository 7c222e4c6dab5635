"""The small measurements behind docs/performance.md, on the CPU at hand:

    python -m experiments.cpu_probes

- resident memory of Python once torch, transformers and datasets are imported (the memory floor's
  runtime share);
- float32 matrix products of SmolLM2's MLP shape (576 -> 1536) with 32 rows (one decode step of 32
  completions) and with 1024 rows (a training micro-batch), in GFLOP/s;
- one token drawn for each of 32 rows over SmolLM2's 49152-token vocabulary: torch.multinomial
  against the inverse-CDF sampler of grpo_multistep.py."""
import time


def rss_gib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 2**20


import torch  # noqa: E402
import transformers  # noqa: E402,F401
import datasets  # noqa: E402,F401

print(f"RSS after importing torch, transformers, datasets: {rss_gib():.2f} GiB")
from grpo_multistep import sample_token  # noqa: E402  (after the figure: it imports more)


def best_ms(f, repeats):
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1000 * min(times)


w = torch.randn(1536, 576)
for rows in (32, 1024):
    x = torch.randn(rows, 576)
    ms = best_ms(lambda: x @ w.T, 50)
    print(f"matmul {rows} x 576 x 1536: {2 * rows * 576 * 1536 / ms / 1e6:.0f} GFLOP/s")
logits = torch.randn(32, 49152)
probs = logits.softmax(-1)
print(f"torch.multinomial, 32 x 49152: {best_ms(lambda: torch.multinomial(probs, 1), 10):.1f} ms")
print(f"sample_token (inverse CDF), 32 x 49152: {best_ms(lambda: sample_token(logits, 1.0), 10):.1f} ms")
