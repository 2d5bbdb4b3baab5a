"""Training dynamics against the exact target: end states, matched accuracy and their plots.

Stage 3 logs the exact measures of the policy every ``validation.every`` steps (``exact/*`` in
``metrics.jsonl``; `disa_jax.eval.exact`). From them:

- `end_state`: where a run stands at its last measurement. It is at its end state when both
  KL(pi || pi~) and the conditional KL over correct answers are flat over the last 20% of the
  measured steps (at least 5 measurements): the least-squares line through each changes across the
  window by less than 2 of its regression standard errors (`trend`; the measurements are
  independent, each draws its own samples). A window inside the learning-rate decay phase is
  flagged (the schedule, not convergence, may flatten a curve), and P(correct) never declares an
  end state. Otherwise its figures are a transient, and every verdict drawn from them says so.
- `matched_accuracy`: the entropy over correct answers and the conditional KL over correct answers
  at the first measurement where P(correct) reaches 0.5 / 0.7 / 0.9, so methods are compared at the
  same accuracy rather than at the same step.
- `plot_dynamics`: KL against step, the conditional KL over correct answers against step, and the
  path of the entropy over correct answers against P(correct), the target marked.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import artifacts
from disa_jax.workflows.stage3 import SERIES_FIELDS, ExactSeries

FIELDS = SERIES_FIELDS
LEVELS = (0.5, 0.7, 0.9)


def exact_series(metrics_path: str | Path) -> ExactSeries:
  """The ``exact/*`` measurements of a Stage 3 metrics file: ``step`` and every field, each ``[M]``
  (`Stage3Run.exact_series` reads its own run's)."""
  return ExactSeries.from_rows(artifacts.read_jsonl(metrics_path, "the Stage 3 metrics"),
                               metrics_path)


def lr_decay_step(total_steps: int, num_minibatches: int, decay_frac: float) -> int | None:
  """The first RL step (0-based) with an optimizer update at the decayed learning rate.

  `disa_jax.optim.lr_schedule` decays the last ``decay_frac`` of the run's
  ``total_steps x num_minibatches`` updates; None for a constant rate (``decay_frac = 0``).
  """
  if decay_frac <= 0:
    return None
  boundary = int(round((1.0 - decay_frac) * total_steps * num_minibatches))
  return boundary // num_minibatches


@dataclasses.dataclass(frozen=True)
class Trend:
  """The least-squares line through a curve's measurements in the end-state window.

  Attributes:
    change: slope x window length: the change the line makes across the window.
    change_se: its standard error from the regression residuals (independent measurements).
    points: measurements in the window.
  """
  change: float
  change_se: float
  points: int

  @property
  def flat(self) -> bool:
    """The change is within 2 standard errors of 0."""
    return abs(self.change) <= 2.0 * self.change_se


def trend(steps: np.ndarray, values: np.ndarray) -> Trend:
  """`Trend` of ``values`` ``[n]`` against ``steps`` ``[n]`` (n >= 3, distinct steps)."""
  x, y = np.asarray(steps, np.float64), np.asarray(values, np.float64)
  if x.size < 3 or np.unique(x).size != x.size:
    raise ValueError(f"trend needs >= 3 measurements at distinct steps, got steps {x.tolist()}")
  if not np.all(np.isfinite(y)):
    raise ValueError(f"trend got non-finite values {y.tolist()} at steps {x.tolist()}")
  xc = x - x.mean()
  sxx = float(np.sum(xc ** 2))
  slope = float(np.sum(xc * (y - y.mean())) / sxx)
  resid = y - y.mean() - slope * xc
  se_slope = float(np.sqrt(np.sum(resid ** 2) / (x.size - 2) / sxx))
  length = float(x[-1] - x[0])
  return Trend(change=slope * length, change_se=se_slope * length, points=int(x.size))


@dataclasses.dataclass(frozen=True)
class EndState:
  """Where a run stands at its last measurement (`end_state`).

  Attributes:
    reached: the run is at its end state (``reason == 'flat'``).
    reason: 'flat' (KL and conditional KL flat over the window, the learning rate constant there) |
      'flat_under_lr_decay' (flat, but the window overlaps the learning-rate decay phase: the
      schedule, not convergence, may have flattened it) | 'moving' (a slope is not within 2
      standard errors of 0) | 'too_few_measurements' (fewer than ``min_points`` in the window).
    window_steps: the first and last step of the window.
    kl: `Trend` of KL(pi || pi~) over the window (None with too few measurements).
    kl_correct: `Trend` of KL(pi|c || pi~|c) over the window (None likewise).
    lr_decay_step: the first RL step trained at the decayed learning rate (None: constant).
    step: the last measured step.
    last: the last measurement's fields (`FIELDS`).
  """
  reached: bool
  reason: str
  window_steps: tuple[int, int]
  kl: Trend | None
  kl_correct: Trend | None
  lr_decay_step: int | None
  step: int
  last: dict[str, float]

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def end_state(series: Mapping[str, np.ndarray], *, window: float = 0.2, min_points: int = 5,
              lr_decay_step: int | None = None) -> EndState:
  """Whether the run is at its end state (see the module docstring), with the figures.

  P(correct) plays no part: a policy can keep moving (and its diversity collapse) after it is
  almost always right.

  Args:
    series: `exact_series` of one run (at least 2 measurements).
    window: the share of the measured steps (the last ones) over which both curves must be flat.
    min_points: fewer measurements in the window are never called flat.
    lr_decay_step: the first RL step of the run's learning-rate decay phase (None: no decay). A
      measurement at a step > this one follows updates at the decayed rate.

  Returns:
    `EndState`.
  """
  steps = np.asarray(series["step"])
  if steps.size < 2:
    raise ValueError(f"end_state needs at least 2 measurements, got {steps.size}")
  if min_points < 3:
    raise ValueError(f"end_state min_points must be >= 3 (a slope and its error), got {min_points}")
  start = steps[-1] - window * (steps[-1] - steps[0])
  inside = steps >= start
  first = int(np.flatnonzero(inside)[0])
  common = dict(window_steps=(int(steps[first]), int(steps[-1])), lr_decay_step=lr_decay_step,
                step=int(steps[-1]), last={f: float(series[f][-1]) for f in FIELDS})
  if inside.sum() < min_points:
    return EndState(reached=False, reason="too_few_measurements", kl=None, kl_correct=None,
                    **common)
  kl = trend(steps[inside], series["kl_mc"][inside])
  kl_c = trend(steps[inside], series["kl_correct"][inside])
  if not (kl.flat and kl_c.flat):
    reason = "moving"
  elif lr_decay_step is not None and steps[-1] > lr_decay_step:
    reason = "flat_under_lr_decay"
  else:
    reason = "flat"
  return EndState(reached=reason == "flat", reason=reason, kl=kl, kl_correct=kl_c, **common)


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
  import matplotlib  # pylint: disable=g-import-not-at-top  (heavy import, plots only)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (heavy import)
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
