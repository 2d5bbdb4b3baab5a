"""Training dynamics against the exact target: end states, matched accuracy and their plots.

Stage 3 logs the exact measures of the policy every ``validation.every`` steps (``exact/*`` in
``metrics.jsonl``; `disa_jax.eval.exact`). From them:

- `end_state`: where a run stands at its last measurement. It is at its end state when P(correct)
  >= 0.9, or when its KL curve is flat: the last 20% of the measured steps change KL(pi || pi~) by
  less than 2 standard errors (over at least 5 measurements). Otherwise its figures are a transient,
  and every verdict drawn from them says so.
- `matched_accuracy`: the entropy over correct answers and the conditional KL over correct answers
  at the first measurement where P(correct) reaches 0.5 / 0.7 / 0.9, so methods are compared at the
  same accuracy rather than at the same step.
- `plot_dynamics`: KL against step, the conditional KL over correct answers against step, and the
  path of the entropy over correct answers against P(correct), the target marked.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

FIELDS = ("p_correct", "entropy_correct", "target_entropy_correct", "kl_mc", "kl_mc_se",
          "kl_binary", "kl_correct", "p_correct_kl_correct", "p_wrong_kl_wrong", "kl_decomposed",
          "kl_decomposed_se")
LEVELS = (0.5, 0.7, 0.9)


def exact_series(metrics_path: str | Path) -> dict[str, np.ndarray]:
  """The ``exact/*`` measurements of a Stage 3 run: ``step`` and every field, each ``[M]``."""
  rows = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
  rows = [r for r in rows if "exact/kl_mc" in r]
  out = {"step": np.asarray([r["step"] for r in rows], np.int64)}
  for f in FIELDS:
    out[f] = np.asarray([r[f"exact/{f}"] for r in rows], np.float64)
  return out


def end_state(series: Mapping[str, np.ndarray], *, window: float = 0.2, p_done: float = 0.9,
              min_points: int = 5) -> dict[str, Any]:
  """Whether the run is at its end state (see the module docstring), with the figures.

  Args:
    series: `exact_series` of one run (at least 2 measurements).
    window: the share of the measured steps over which the KL must be flat.
    p_done: the P(correct) that counts as the end state by itself.
    min_points: a curve of fewer measurements is never called flat (two noisy points say little).

  Returns:
    ``reached`` (bool), ``reason`` ('p_correct' | 'flat' | 'transient'), ``kl_change`` over the
    window, ``kl_se`` (the last measurement's), and the last measurement's fields.
  """
  steps, kl = series["step"], series["kl_mc"]
  if steps.size < 2:
    raise ValueError(f"end_state needs at least 2 measurements, got {steps.size}")
  start = steps[-1] - window * (steps[-1] - steps[0])
  first = int(np.searchsorted(steps, start))  # the first measurement inside the window
  first = min(first, steps.size - 2)
  change = float(kl[-1] - kl[first])
  se = float(np.hypot(series["kl_mc_se"][-1], series["kl_mc_se"][first]))
  last = {f: float(series[f][-1]) for f in FIELDS}
  if last["p_correct"] >= p_done:
    reason = "p_correct"
  elif abs(change) < 2.0 * se and steps.size >= min_points:
    reason = "flat"
  else:
    reason = "transient"
  return {"reached": reason != "transient", "reason": reason, "kl_change": change, "kl_se": se,
          "window_steps": [int(steps[first]), int(steps[-1])], "step": int(steps[-1]), **last}


def matched_accuracy(series: Mapping[str, np.ndarray], levels: Sequence[float] = LEVELS
                     ) -> dict[str, dict[str, float] | None]:
  """The first measurement at which P(correct) >= each level (None if never reached)."""
  out: dict[str, dict[str, float] | None] = {}
  for level in levels:
    hit = np.flatnonzero(series["p_correct"] >= level)
    if not hit.size:
      out[f"{level:g}"] = None
      continue
    i = int(hit[0])
    out[f"{level:g}"] = {"step": int(series["step"][i]), "p_correct": float(series["p_correct"][i]),
                         "entropy_correct": float(series["entropy_correct"][i]),
                         "kl_correct": float(series["kl_correct"][i]),
                         "kl": float(series["kl_mc"][i])}
  return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
  """Mean and sample std (0 for one value) of finite values; NaN mean for none."""
  v = np.asarray([x for x in values if x is not None and np.isfinite(x)], np.float64)
  if not v.size:
    return float("nan"), float("nan")
  return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def plot_dynamics(series: Mapping[str, Mapping[str, np.ndarray]], target_entropy: float,
                  out_dir: Path) -> list[str]:
  """Three PNGs from the runs' exact measurements (one line per run); returns their names."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  files = []
  for name, key, ylabel, log in (("kl_vs_step.png", "kl_mc", "KL(pi || pi~) (nats)", True),
                                 ("kl_correct_vs_step.png", "kl_correct",
                                  "KL(pi|correct || pi~|correct) (nats)", False)):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for run, s in series.items():
      ax.plot(s["step"], s[key], label=run)
      if key == "kl_mc":
        ax.fill_between(s["step"], s[key] - 2 * s["kl_mc_se"], s[key] + 2 * s["kl_mc_se"], alpha=0.2)
    if log:
      ax.set_yscale("log")
    ax.set_xlabel("RL step"), ax.set_ylabel(ylabel), ax.legend(fontsize=8)
    fig.tight_layout(), fig.savefig(out_dir / name, dpi=110), plt.close(fig)
    files.append(name)
  fig, ax = plt.subplots(figsize=(5.6, 4.2))
  for run, s in series.items():
    ax.plot(s["p_correct"], s["entropy_correct"], marker=".", label=run)
  ax.plot([1.0], [target_entropy], "k*", ms=14, label="target pi~")
  ax.axhline(target_entropy, color="k", lw=0.6, ls=":")
  ax.set_xlabel("P(correct)"), ax.set_ylabel("entropy over correct answers (nats)")
  ax.legend(fontsize=8)
  fig.tight_layout(), fig.savefig(out_dir / "entropy_vs_accuracy.png", dpi=110), plt.close(fig)
  return files + ["entropy_vs_accuracy.png"]
