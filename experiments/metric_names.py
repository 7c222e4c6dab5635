"""The core's metrics as the experiments read them: TRL's names, or the names that earlier versions of
grpo_multistep.py logged, so that rows and metrics.jsonl files written before the renaming still read."""

EARLIER = {"completions/mean_length": "completion_length", "clip_ratio/low_mean": "clip_ratio_low",
           "clip_ratio/high_mean": "clip_ratio_high"}


def metric(metrics, name, default=None):
    """metrics[name] under TRL's name (a key of EARLIER), else under its earlier name, else default."""
    if name in metrics:
        return metrics[name]
    return metrics.get(EARLIER.get(name), default)


def clip_fraction(metrics):
    """The share of tokens whose ratio the clip held, at either bound."""
    return metric(metrics, "clip_ratio/low_mean") + metric(metrics, "clip_ratio/high_mean")
