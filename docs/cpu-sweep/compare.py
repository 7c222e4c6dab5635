"""The README's reading of a seeded sweep: each μ's reward at equal completions generated and at equal
wall-clock seconds, mean ± sd over seeds (linear interpolation between logged points).

    python docs/cpu-sweep/compare.py docs/cpu-sweep/sweep.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict

import numpy as np


def main(path):
    runs = defaultdict(list)  # (mu, seed) -> generation points, in order
    for line in open(path):
        p = json.loads(line)
        if p.get("generated") and p.get("reward") is not None:
            runs[p["mu"], p["seed"]].append(p)
    mus = sorted({mu for mu, _ in runs})
    # The common budgets: the fewest completions and the fewest seconds any run reached.
    completions = min(pts[-1]["generated_completions"] for pts in runs.values())
    seconds = min(pts[-1]["elapsed"] for pts in runs.values())
    for axis, budget in (("generated_completions", completions), ("elapsed", seconds)):
        print(f"reward at {axis} = {budget:.4g} (mean ± sd over seeds):")
        for mu in mus:
            values = [float(np.interp(budget, [p[axis] for p in pts], [p["reward"] for p in pts]))
                      for (m, _), pts in runs.items() if m == mu]
            sd = statistics.stdev(values) if len(values) > 1 else 0.0
            print(f"  μ={mu}: {statistics.mean(values):.1f} ± {sd:.1f}  (seeds: {', '.join(f'{v:.1f}' for v in values)})")
    print("reward at the first and last generation batch (mean over seeds):")
    for mu in mus:
        firsts = [pts[0]["reward"] for (m, _), pts in runs.items() if m == mu]
        lasts = [pts[-1]["reward"] for (m, _), pts in runs.items() if m == mu]
        print(f"  μ={mu}: {statistics.mean(firsts):.1f} -> {statistics.mean(lasts):.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
