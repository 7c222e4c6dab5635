"""Tests of experiments/benchmark.py: the cost model on hand-made rows with known answers, the rule against
the addition study's g*, and the benchmark end to end on the tiny model of tests/conftest.py (`tiny`), the
one that tests/test_train_tldr.py runs the demo on."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

from experiments import benchmark

pytestmark = pytest.mark.usefixtures("one_thread")  # Fixtures of tests/conftest.py, as is tiny.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # The repository's root.


def tables_of(text):
    """[{header: [the rows' cells]}] for each markdown table in text, in order."""
    found, rows = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows:
            found.append({h: [row[i] for row in rows[2:]] for i, h in enumerate(rows[0])})
            rows = []
    return found


def test_the_cost_model_from_known_rows(monkeypatch, tmp_path):
    """g = 0.6, l = 0.15, r_4 = 2: T(2, 1) = 0.4 + 0.75/2, T(4, 1) = 0.4 + 0.75/4,
    T(1, 4) = 0.4 + (1.2 + 0.6)/4; w*(2) = 0.4 + 0.15, w*(4) = 0.4 + 0.05, w*_4 = (1.6 + 1.2 + 0.6 - 1)/3.
    Against g*: 0.6 lies above [0.2, 0.5], below [0.7, 0.9] and inside [0.5, ≥ 1]."""
    def row(name, generate, logps, total):
        return {"configuration": name, "generate": generate, "logps": logps, "total": total}
    rows = [row("μ=1 β=0 fp32", 6.0, 0.0, 10.0), row("μ=4 β=0 fp32 generation step", 6.0, 1.5, 14.0),
            row("μ=4 β=0 fp32 per step over a cycle", 1.5, 0.4, 6.0),
            row("μ=1 S=4 β=0 fp32 generation step", 12.0, 6.0, 30.0),
            row("μ=1 S=4 β=0 fp32 per step over a cycle", 3.0, 1.5, 7.5)]
    config, _ = benchmark.parse_args([])
    monkeypatch.setattr(benchmark, "SUMMARY", str(tmp_path / "summary.json"))
    text = benchmark.cost_model(rows, config)
    assert "g = 0.600" in text and "l = 0.150" in text and "r_4 = 2.000" in text
    assert "93.8 ms per token for one generation batch (32 completions), 188 ms for one 4× larger" in text
    (arms,) = tables_of(text)
    assert arms["arm"] == ["μ=2", "μ=4", "S=4"]
    assert arms["T(μ, S)/T(1, 1) predicted"] == ["0.775", "0.588", "0.850"]
    assert arms["measured"] == ["—", "0.600", "0.750"]
    assert arms["break-even worth w*"] == ["0.550", "0.450", "0.800"]
    assert "summary.json does not exist: no g* to set beside g = 0.600." in text

    def entry(arm, r, low, mean, high):
        return {"arm": arm, "r": r, "completions": 8192, "g_star": {"mean": mean, "low": low, "high": high}}
    found = [entry("μ=2", 1.0, 0.2, 0.3, 0.5), entry("μ=4", 1.0, 0.7, 0.8, 0.9),
             entry("S=4", 0.25, 0.5, 0.95, 1.3)]
    (tmp_path / "summary.json").write_text(json.dumps({"break_even": {"rows": found}}))
    _, rule = tables_of(benchmark.cost_model(rows, config))
    assert rule["g* [interval]"] == ["0.30 [0.20, 0.50]", "0.80 [0.70, 0.90]", "0.95 [0.50, ≥ 1]"]
    assert rule["here, g = 0.600"] == ["pays", "does not pay", "undecided"]
    assert rule["r"] == ["1", "1", "0.25"] and rule["completions"] == ["8,192"] * 3
    assert "need the μ = 1, μ = 4 and S = 4" in benchmark.cost_model(rows[1:], config)


def test_the_committed_summary_gives_the_rule_a_g_star_for_every_arm_and_budget():
    (rule,) = tables_of(benchmark.break_even_rule(0.9))
    assert sorted(set(rule["arm"])) == ["S=4", "μ=2", "μ=4", "μ=8"] and len(rule["arm"]) == 10
    assert set(rule["here, g = 0.900"]) <= {"pays", "does not pay", "undecided"}


def test_phase_rows_split_generation_and_reuse_steps():
    def step(elapsed, gen):
        return {"elapsed": elapsed, "time_generate": gen, "time_logps": gen / 2, "time_forward": 1.0,
                "time_backward": 2.0, "time_optimizer": 0.5, "peak_rss_gib": 1.5}
    records = [step(10.0, 4.0), step(14.0, 0.0), step(24.0, 4.0), step(28.0, 0.0)]  # μ=2: gen, reuse, ...
    gen, reuse, cycle = benchmark.phase_rows("x", records, mu=2)
    assert (gen["steps"], gen["total"], gen["generate"], gen["other"]) == (2, 10.0, 4.0, 0.5)
    assert (reuse["steps"], reuse["total"], reuse["logps"], reuse["other"]) == (2, 4.0, 0.0, 0.5)
    assert cycle["total"] == 7.0 and cycle["other %"] == pytest.approx(100 * 0.5 / 7)
    assert gen["peak RSS GiB"] == 1.5
    labels = [r["configuration"] for r in benchmark.phase_rows("x", records, mu=1, s=2)]  # S=2: one cycle
    assert labels == ["x generation step", "x later mini-batch steps", "x per step over a cycle"]


def test_the_benchmark_measures_each_arm_in_a_fresh_process_and_its_formulas_match_its_table(
        tiny, tmp_path, monkeypatch, capsys):
    """μ = 1, μ = 4 and S = 4 at β = 0, a child process each, with fixed-length decoding; the cost model that
    it prints is the formulas applied to the table that it writes."""
    monkeypatch.setattr(benchmark, "CONFIGURATIONS", [(1, 1, 0.0), (4, 1, 0.0), (1, 4, 0.0)])
    monkeypatch.setattr(benchmark, "SUMMARY", str(tmp_path / "no-summary.json"))
    argv = tiny.args(tmp_path / "bench-μ={mu}", "--benchmark-steps", "1")
    assert benchmark.main(argv) == 0
    folder = tmp_path / "bench-μ=1,4-benchmark"
    for name, steps in (("μ=1-β=0-fp32", [1]), ("μ=4-β=0-fp32", [1, 2, 3, 4]),
                        ("μ=1-S=4-β=0-fp32", [1, 2, 3, 4])):
        records = tiny.metrics(folder / name)
        assert [r["step"] for r in records] == steps  # 1 step rounded up to a whole cycle of μ·S steps
        assert records[0]["completions/mean_length"] == 8  # fixed length: no completion ends early
        assert all(r["time_generate"] == r["time_logps"] == 0 for r in records[1:])  # no generation, no π_old
        assert os.listdir(folder / name) == ["metrics.jsonl"]  # no checkpoints, no model
    text = open(folder / "benchmark.md").read()
    phases, arms = tables_of(text)
    row = {c: {k: float(v[i]) for k, v in phases.items() if k != "configuration"}
           for i, c in enumerate(phases["configuration"])}
    assert list(row) == ["μ=1 β=0 fp32", "μ=4 β=0 fp32 generation step", "μ=4 β=0 fp32 reuse steps",
                         "μ=4 β=0 fp32 per step over a cycle", "μ=1 S=4 β=0 fp32 generation step",
                         "μ=1 S=4 β=0 fp32 later mini-batch steps", "μ=1 S=4 β=0 fp32 per step over a cycle"]
    one, four = row["μ=1 β=0 fp32"], row["μ=4 β=0 fp32 generation step"]
    big = row["μ=1 S=4 β=0 fp32 generation step"]
    g, l, r = one["generate"] / one["total"], four["logps"] / one["total"], big["generate"] / one["generate"]

    def printed(pattern):
        return float(re.search(pattern, text)[1])

    def close(a, b):  # the table: 3 significant digits
        return math.isclose(a, b, rel_tol=0.01, abs_tol=0.002)
    assert close(printed(r"- g = ([\d.]+)"), g) and close(printed(r"- l = ([\d.]+)"), l)
    assert close(printed(r"r_4 = ([\d.]+)"), r)
    assert close(printed(r"decode: ([\d.e-]+) ms per token"), 1000 * one["generate"] / 8)
    assert close(printed(r"([\d.e-]+) ms for one 4× larger"), 1000 * big["generate"] / 8)
    predicted = {"μ=2": (1 - g) + (g + l) / 2, "μ=4": (1 - g) + (g + l) / 4,
                 "S=4": (1 - g) + (g * r + 4 * l) / 4}
    measured = {"μ=4": row["μ=4 β=0 fp32 per step over a cycle"]["total"] / one["total"],
                "S=4": row["μ=1 S=4 β=0 fp32 per step over a cycle"]["total"] / one["total"]}
    worth = {"μ=2": 1 - g + l, "μ=4": 1 - g + l / 3, "S=4": (4 * (1 - g) + g * r + 4 * l - 1) / 3}
    for i, arm in enumerate(arms["arm"]):
        assert close(float(arms["T(μ, S)/T(1, 1) predicted"][i]), predicted[arm])
        if arm == "μ=2":  # not among the configurations: predicted only
            assert arms["measured"][i] == "—"
        else:
            assert close(float(arms["measured"][i]), measured[arm])
        assert close(float(arms["break-even worth w*"][i]), worth[arm])
    out = capsys.readouterr().out
    assert "no-summary.json does not exist" in text and text.split("\n\n", 1)[1].strip() in out


@pytest.mark.parametrize("name, flag", [("benchmark", "--benchmark-steps"), ("ab", "--demo")])
def test_each_experiment_runs_as_a_module_from_the_root(name, flag):
    """python -m experiments.NAME from the repository's root: none edits sys.path to find the demo."""
    help_text = subprocess.run([sys.executable, "-m", f"experiments.{name}", "--help"],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and flag in help_text.stdout, help_text.stderr
