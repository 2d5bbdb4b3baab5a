"""Training dynamics against the exact target: end states, matched accuracy and their plots.

Stage 3 logs the exact measures of the policy every ``validation.every`` steps (``exact/*`` in
``metrics.jsonl``; `disa_jax.eval.exact`). From them:

- `end_state`: where a run stands at its last measurement, decided by equivalence (two one-sided
  tests), not by the absence of a significant slope. Over the window (the last ``window`` share
  of the measured steps, `EndStateConfig`), a straight line is fitted by weighted least squares to
  each of two curves: the primary KL, ``kl_decomposed`` (its only sampled term carries the
  measurement's Monte Carlo standard error ``kl_decomposed_se``), and the conditional KL over
  correct answers ``kl_correct`` (exact over the enumerated correct set: standard error 0). Each
  measurement's variance is its Monte Carlo variance plus a common excess tau^2 (the policy's own
  wandering between measurements), tau^2 estimated so that the weighted residuals match their
  degrees of freedom (Paule-Mandel; with no Monte Carlo error this is ordinary least squares).
  The wandering is slow, so consecutive measurements are correlated: the change's standard error
  and degrees of freedom use the effective sample size of the residuals' lag-1 autocorrelation
  (``serial`` 'ar1', `wls_change`). A curve is *flat* when the ``level`` (90%) interval of the
  line's change across the window lies inside +-delta, delta = max(delta_rel x |the line's mean
  level over the window|, delta_abs): a margin relative to the curve (0.3: a curve still falling
  by 30% of its value is outside it), floored at what the measurements resolve (delta_abs, 0.001
  nats); it is *moving* when that interval lies entirely outside +-delta; otherwise the
  measurements cannot tell (*unresolved*). The rule's error rates on simulated curves are in
  docs/reports/end_state_rule.md (`pipeline.end_state_sim`). A run is at its end state when both
  curves are flat and the window's learning rate was constant; with fewer than ``min_points``
  measurements in the window it is undecided. P(correct) plays no part: a policy can keep moving
  (and its diversity collapse) after it is almost always right.
- `method_end_state`: the same rule for a method, pooled over its Stage 3 seeds (the mean of the
  seeds' changes, with a standard error from their own errors or from their spread, whichever is
  larger).
- `matched_accuracy`: the entropy over correct answers, the conditional KL over correct answers and
  the KL where P(correct) reaches 0.5 / 0.7 / 0.9, interpolated linearly between the two
  measurements around the level, so methods are compared at the same accuracy rather than at the
  same step; a run already past a level at its first measurement is flagged (no match there).
- `plot_dynamics`: the primary KL against step, the conditional KL over correct answers against
  step, and the path of the entropy over correct answers against P(correct), the target marked.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import artifacts, codec
from disa_jax.pipeline import seed_stats
from disa_jax.workflows.stage3 import SERIES_FIELDS, ExactSeries

FIELDS = SERIES_FIELDS
LEVELS = (0.5, 0.7, 0.9)
PRIMARY, PRIMARY_SE = "kl_decomposed", "kl_decomposed_se"  # the KL every verdict uses
CONDITIONAL = "kl_correct"  # exact over the correct set: no Monte Carlo error
_BISECTIONS = 60
RHO_MAX = 0.9  # the largest lag-1 autocorrelation the standard error allows for
SERIAL = ("ar1", "none")  # `EndStateConfig.serial`


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndStateConfig:
  """The end-state rule's settings (`MainConfig.end_state`; configs/main.py documents them).

  Attributes:
    window: the share of the measured steps (the last ones) the curves must be flat over.
    min_points: fewer measurements in the window leave the run undecided.
    delta_rel: the equivalence margin relative to the curve: this share of the line's mean level
      over the window (its value halfway across it).
    delta_abs: the margin's floor in nats: what the measurements resolve. At the default job's
      cadence (14 measurements in the window, 32 samples per prompt: a Monte Carlo SE of
      0.0003-0.0009 nats per measurement) the smallest change across the window a 90% interval
      detects with 80% power is (1.64 + 0.84) x 0.86 x SE = 0.0006-0.0019 nats; below 0.001 nats
      a relative margin would ask for more than the measurement gives.
    level: the confidence level of the change's interval (0.9: two one-sided tests at 5%).
    serial: 'ar1': the change's standard error and degrees of freedom allow for serial
      correlation between consecutive measurements (lag-1 autocorrelation of the residuals,
      effective sample size n (1 - r) / (1 + r)); 'none': measurements taken as independent.
  """
  window: float = 0.25
  min_points: int = 10
  delta_rel: float = 0.3
  delta_abs: float = 0.001
  level: float = 0.9
  serial: str = "ar1"

  def __post_init__(self):
    checks = (("window", 0 < self.window <= 1, "in (0, 1]"),
              ("min_points", isinstance(self.min_points, int) and self.min_points >= 3,
               "an int >= 3 (a line and its error)"),
              ("delta_abs", self.delta_abs > 0, "> 0"), ("delta_rel", self.delta_rel >= 0, ">= 0"),
              ("level", 0 < self.level < 1, "in (0, 1)"),
              ("serial", self.serial in SERIAL, f"one of {SERIAL}"))
    for name, ok, want in checks:
      if not ok:
        raise ValueError(f"end_state.{name} must be {want}, got {getattr(self, name)!r}")

  def window_start(self, first: float, last: float) -> float:
    """The first step of the window over measurements at steps ``first``..``last``."""
    return last - self.window * (last - first)

  def delta(self, level: np.ndarray | float) -> np.ndarray:
    """The equivalence margin of a curve whose line's mean level over the window is ``level``
    (elementwise): max(delta_rel x |level|, delta_abs)."""
    return np.maximum(self.delta_rel * np.abs(np.asarray(level, np.float64)), self.delta_abs)


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


def _wls(u: np.ndarray, y: np.ndarray, var: np.ndarray):
  """Weighted least squares of ``y`` ``[..., n]`` on ``u`` ``[n]`` with variances ``var``:
  (slope, sum w (u - u_w)^2, weighted residual sum of squares, the line's value at u[-1])."""
  w = 1.0 / var
  sw = w.sum(-1)
  um, ym = (w * u).sum(-1) / sw, (w * y).sum(-1) / sw
  uc = u - um[..., None]
  suu = (w * uc ** 2).sum(-1)
  slope = (w * uc * (y - ym[..., None])).sum(-1) / suu
  resid = y - ym[..., None] - slope[..., None] * uc
  return slope, suu, (w * resid ** 2).sum(-1), ym + slope * (u[-1] - um)


def _lag1(u: np.ndarray, y: np.ndarray, var: np.ndarray, slope: np.ndarray, value: np.ndarray
          ) -> np.ndarray:
  """The lag-1 autocorrelation of the standardised residuals of the line (``[...]``), corrected
  for its small-sample bias (Kendall: E r ~ rho - (1 + 3 rho) / n) and clipped to
  [0, `RHO_MAX`]: a negative estimate is taken as 0, never as a gain in precision."""
  n = u.size
  r = (y - value[..., None] - slope[..., None] * (u - u[-1])) / np.sqrt(var)
  num, den = (r[..., :-1] * r[..., 1:]).sum(-1), (r ** 2).sum(-1)
  raw = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
  return np.clip((n * raw + 1.0) / (n - 3.0), 0.0, RHO_MAX) if n > 3 else np.zeros_like(raw)


def wls_change(steps: np.ndarray, values: np.ndarray, se: np.ndarray | None = None, *,
               serial: str = "ar1") -> dict[str, np.ndarray]:
  """The change of the weighted least-squares line across ``steps`` (vectorised over curves).

  Each measurement's variance is se_i^2 + tau^2; tau^2 >= 0 is the smallest value for which the
  weighted residual sum of squares is at most n - 2 (Paule-Mandel, by bisection). With every
  ``se`` 0 this is ordinary least squares (tau^2 = RSS / (n - 2)); when the Monte Carlo errors
  explain the scatter, tau^2 = 0 and the change's error comes from them alone. With ``serial``
  'ar1' consecutive measurements may be correlated (the policy wanders slowly between them): r,
  the residuals' lag-1 autocorrelation (`_lag1`), gives an effective sample size
  n_eff = n (1 - r) / (1 + r), the degrees of freedom n_eff - 2 (rounded down, at least 1) and
  the standard error inflated by sqrt((n - 2) / (n_eff - 2)) (Santer et al. 2000, J. Geophys.
  Res. 105(D6)).

  Args:
    steps: ``[n]`` distinct measurement steps (n >= 3).
    values: ``[..., n]`` the curves.
    se: ``[..., n]`` (or broadcastable) standard errors of the measurements (None: all 0).
    serial: 'ar1' | 'none' (`EndStateConfig.serial`).

  Returns:
    ``change``, ``change_se``, ``df``, ``tau``, ``rho`` (the autocorrelation used; 0 with 'none'),
    and ``value`` (the line at the last step), each ``[...]``.
  """
  x = np.asarray(steps, np.float64)
  y = np.asarray(values, np.float64)
  s2 = np.broadcast_to(np.zeros(()) if se is None else np.asarray(se, np.float64) ** 2, y.shape)
  if x.ndim != 1 or x.size < 3 or np.unique(x).size != x.size or y.shape[-1] != x.size:
    raise ValueError(f"a trend needs >= 3 measurements at distinct steps, one value each, got "
                     f"steps {x.tolist()} and values of shape {y.shape}")
  if not (np.all(np.isfinite(y)) and np.all(np.isfinite(s2)) and np.all(s2 >= 0)):
    raise ValueError(f"a trend got non-finite values or standard errors: values {y.tolist()}, "
                     f"se^2 {np.asarray(s2).tolist()} at steps {x.tolist()}")
  if serial not in SERIAL:
    raise ValueError(f"wls_change: serial must be one of {SERIAL}, got {serial!r}")
  u = (x - x[0]) / (x[-1] - x[0])  # the window as [0, 1]: the slope is the change across it
  dof = x.size - 2
  hi = np.asarray(_wls(u, y, np.ones_like(y))[2] / dof)  # OLS RSS / dof: Q(hi) <= dof
  floor = np.asarray(1e-12 * (hi + s2.mean(-1)) + 1e-300)[..., None]
  var_of = lambda t2: np.maximum(s2 + np.asarray(t2)[..., None], floor)
  q_of = lambda t2: _wls(u, y, var_of(t2))[2]
  lo, hi = np.zeros_like(hi), hi.copy()
  solve = q_of(lo) > dof  # Monte Carlo errors alone do not explain the scatter
  for _ in range(_BISECTIONS):
    mid = 0.5 * (lo + hi)
    above = q_of(mid) > dof
    lo, hi = np.where(above, mid, lo), np.where(above, hi, mid)
  t2 = np.where(solve, hi, 0.0)
  var = var_of(t2)
  slope, suu, _, value = _wls(u, y, var)
  rho = _lag1(u, y, var, slope, value) if serial == "ar1" else np.zeros_like(slope)
  df = np.maximum(np.floor(x.size * (1.0 - rho) / (1.0 + rho) - 2.0 + 1e-9), 1.0)
  return {"change": slope, "change_se": np.sqrt(dof / df / suu), "df": df,
          "tau": np.sqrt(t2), "rho": rho, "value": value}


def equivalence(change: np.ndarray, se: np.ndarray, df: np.ndarray | float, level: np.ndarray,
                cfg: EndStateConfig) -> dict[str, np.ndarray]:
  """The equivalence verdict of changes ``change`` +- ``se`` (``df`` degrees of freedom) of curves
  whose line's mean level over the window is ``level`` (elementwise): the ``cfg.level`` interval
  [low, high], the margin delta (`EndStateConfig.delta`) and 'flat' (the interval inside
  (-delta, delta)), 'moving' (entirely outside it) or 'unresolved' (neither)."""
  change, se, level = (np.asarray(v, np.float64) for v in (change, se, level))
  df = np.broadcast_to(np.asarray(df, np.float64), change.shape)
  q = 0.5 + cfg.level / 2.0
  quantiles = {d: seed_stats.t_quantile(q, d) for d in np.unique(df).tolist()}
  half = np.vectorize(quantiles.__getitem__, otypes=[np.float64])(df) * se
  low, high, delta = change - half, change + half, cfg.delta(level)
  flat = (low > -delta) & (high < delta)
  moving = (low >= delta) | (high <= -delta)
  return {"low": low, "high": high, "delta": delta,
          "verdict": np.where(flat, "flat", np.where(moving, "moving", "unresolved"))}


def window_mask(steps: np.ndarray, cfg: EndStateConfig = EndStateConfig()) -> np.ndarray:
  """``[M]`` the measurements in the end-state window: the last ``cfg.window`` of the measured
  steps (``[M]``, ascending)."""
  steps = np.asarray(steps)
  return steps >= cfg.window_start(steps[0], steps[-1])


@dataclasses.dataclass(frozen=True)
class Trend:
  """One curve's line over the end-state window and its equivalence verdict (`trend`).

  Attributes:
    change: the line's change across the window (nats).
    change_se: its standard error (allowing for serial correlation, `wls_change`).
    df: the degrees of freedom of its interval.
    low, high: the ``level`` interval of the change.
    delta: the margin the interval must lie inside (`EndStateConfig.delta` at the line's mean
      level over the window, value - change / 2).
    value: the line's value at the last step.
    tau: the excess scatter between measurements beyond their Monte Carlo errors (0 when those
      explain it; None for a pooled trend).
    points: measurements in the window (per seed for a pooled trend: the fewest).
    verdict: 'flat' | 'moving' | 'unresolved' (`equivalence`).
    rho: the lag-1 autocorrelation the error allows for (None: a pooled trend, or a report from
      before it).
  """
  change: float
  change_se: float
  df: float
  low: float
  high: float
  delta: float
  value: float
  tau: float | None
  points: int
  verdict: str
  rho: float | None = None

  @property
  def flat(self) -> bool:
    return self.verdict == "flat"

  @classmethod
  def decide(cls, change: float, se: float, df: float, value: float, cfg: EndStateConfig,
             **rest: Any) -> "Trend":
    """The verdict of a change ``change`` +- ``se`` (``df`` degrees of freedom) of a line ending
    at ``value`` (`equivalence`)."""
    eq = equivalence(change, se, df, value - change / 2.0, cfg)
    return cls(change=float(change), change_se=float(se), df=float(df), low=float(eq["low"]),
               high=float(eq["high"]), delta=float(eq["delta"]), value=float(value),
               verdict=str(eq["verdict"]), **rest)


def trend(steps: np.ndarray, values: np.ndarray, se: np.ndarray | None = None,
          cfg: EndStateConfig = EndStateConfig()) -> Trend:
  """`Trend` of ``values`` ``[n]`` (standard errors ``se``, None: 0) against ``steps`` ``[n]``."""
  fit = wls_change(steps, values, se, serial=cfg.serial)
  return Trend.decide(fit["change"], fit["change_se"], fit["df"], fit["value"], cfg,
                      tau=float(fit["tau"]), rho=float(fit["rho"]),
                      points=int(np.asarray(steps).size))


@dataclasses.dataclass(frozen=True)
class EndState:
  """Where a run (or a method, `method_end_state`) stands at its last measurement (`end_state`).

  Attributes:
    reached: at its end state (``reason == 'flat'``).
    reason: 'flat' (both curves flat, the learning rate constant over the window) |
      'flat_under_lr_decay' (flat, but the window overlaps the learning-rate decay phase: the
      schedule, not convergence, may have flattened it) | 'moving' (a curve's interval lies
      outside +-delta) | 'unresolved' (a curve's interval straddles the margin) |
      'too_few_measurements' (fewer than ``min_points`` in the window).
    points: measurements in the window (the fewest of a method's seeds).
    min_points: the measurements the rule needs there.
    kl: `Trend` of the primary KL (`PRIMARY`) over the window (None with too few measurements).
    kl_correct: `Trend` of KL(pi|c || pi~|c) over the window (None likewise).
    window_steps: the first and last step of the window (a method: of its first seed).
    lr_decay_step: the first RL step trained at the decayed learning rate (None: constant).
    step: the last measured step.
    last: the last measurement's fields (`FIELDS`; a method: the mean over its seeds).
    seeds: the Stage 3 seeds behind it (1 for a run).
  """
  reached: bool
  reason: str
  points: int
  min_points: int
  kl: Trend | None
  kl_correct: Trend | None
  window_steps: tuple[int, int]
  lr_decay_step: int | None
  step: int
  last: dict[str, float]
  seeds: int = 1

  @property
  def label(self) -> str:
    """The state in words, as the report prints it."""
    if self.reason == "too_few_measurements":
      return (f"undecided ({self.points} measurements in the window, {self.min_points} needed)")
    return {"flat": "end state (KL and conditional KL flat within the margin)",
            "moving": "transient (KL or conditional KL still moving)",
            "unresolved": "undecided (the change's 90% interval reaches beyond the margin: too "
                          "noisy to show flat)",
            "flat_under_lr_decay": "undecided (flat only inside the lr decay phase: the schedule, "
                                   "not convergence, may have flattened it)"}[self.reason]

  def json_extra(self) -> dict[str, str]:
    """What `codec.encode` writes after the fields (the report's ``end_state`` entries)."""
    return {"label": self.label}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeedEndState:
  """One Stage 3 seed's end state (report.json's ``end_state[method]`` entries: the `EndState`'s
  keys, its label, then the ``seed``)."""
  state: EndState = codec.field(inline=True)
  seed: int


def _reason(trends: Sequence[Trend], last_step: int, lr_decay: int | None) -> str:
  verdicts = {t.verdict for t in trends}
  if "moving" in verdicts:
    return "moving"
  if "unresolved" in verdicts:
    return "unresolved"
  return "flat_under_lr_decay" if lr_decay is not None and last_step > lr_decay else "flat"


def end_state(series: Mapping[str, np.ndarray], cfg: EndStateConfig = EndStateConfig(), *,
              lr_decay_step: int | None = None) -> EndState:
  """Whether the run is at its end state (see the module docstring), with the figures.

  Args:
    series: `exact_series` of one run (at least 2 measurements).
    cfg: the rule's window, margin and level.
    lr_decay_step: the first RL step of the run's learning-rate decay phase (None: no decay). A
      measurement at a step > this one follows updates at the decayed rate.

  Returns:
    `EndState`.
  """
  steps = np.asarray(series["step"])
  if steps.size < 2:
    raise ValueError(f"end_state needs at least 2 measurements, got {steps.size}")
  inside = window_mask(steps, cfg)
  first = int(np.flatnonzero(inside)[0])
  common = dict(points=int(inside.sum()), min_points=cfg.min_points,
                window_steps=(int(steps[first]), int(steps[-1])), lr_decay_step=lr_decay_step,
                step=int(steps[-1]), last={f: float(series[f][-1]) for f in FIELDS})
  if inside.sum() < cfg.min_points:
    return EndState(reached=False, reason="too_few_measurements", kl=None, kl_correct=None,
                    **common)
  kl = trend(steps[inside], series[PRIMARY][inside], series[PRIMARY_SE][inside], cfg)
  kl_c = trend(steps[inside], series[CONDITIONAL][inside], None, cfg)
  reason = _reason((kl, kl_c), int(steps[-1]), lr_decay_step)
  return EndState(reached=reason == "flat", reason=reason, kl=kl, kl_correct=kl_c, **common)


def pool_trends(trends: Sequence[Trend], cfg: EndStateConfig = EndStateConfig()) -> Trend:
  """One curve pooled over a method's seeds: the mean change, its variance the larger of
  sum(se_i^2) / k^2 (the seeds' own errors; Welch-Satterthwaite degrees of freedom) and the
  spread var(change_i) / k (k - 1 degrees of freedom), and the margin at the mean value."""
  c = np.asarray([t.change for t in trends], np.float64)
  se2 = np.asarray([t.change_se for t in trends], np.float64) ** 2
  k = c.size
  own = se2.sum() / k ** 2
  spread = float(c.var(ddof=1)) / k if k > 1 else 0.0
  if spread > own:
    var, df = spread, float(k - 1)
  else:
    df_i = np.asarray([t.df for t in trends], np.float64)
    var, df = own, _satterthwaite(se2, df_i) if own > 0 else float(df_i.sum())
  return Trend.decide(float(c.mean()), float(np.sqrt(var)), df,
                      float(np.mean([t.value for t in trends])), cfg, tau=None,
                      points=min(t.points for t in trends))


def _satterthwaite(se2: np.ndarray, df_i: np.ndarray) -> float:
  """Welch-Satterthwaite degrees of freedom of sum(se2); where the squares underflow (a stuck
  curve's se ~ 1e-150: 0 / 0), the same formula on se2 / max(se2), which it does not change."""
  with np.errstate(invalid="ignore", under="ignore"):
    df = float(se2.sum() ** 2 / np.sum(se2 ** 2 / df_i))
  if np.isfinite(df):
    return df
  w = se2 / se2.max()
  return float(w.sum() ** 2 / np.sum(w ** 2 / df_i))


def method_end_state(ends: Sequence[EndState], cfg: EndStateConfig = EndStateConfig()) -> EndState:
  """A method's end state from its seeds' (`end_state`): both curves pooled (`pool_trends`); too
  few measurements in any seed's window leave it undecided, and a window in any seed's lr decay
  phase is flagged."""
  if not ends:
    raise ValueError("method_end_state needs the end state of at least one seed")
  last = {f: float(np.mean([e.last[f] for e in ends])) for f in FIELDS}
  common = dict(points=min(e.points for e in ends), min_points=cfg.min_points,
                window_steps=ends[0].window_steps, lr_decay_step=ends[0].lr_decay_step,
                step=max(e.step for e in ends), last=last, seeds=len(ends))
  if any(e.kl is None or e.kl_correct is None for e in ends):
    return EndState(reached=False, reason="too_few_measurements", kl=None, kl_correct=None,
                    **common)
  kl = pool_trends([e.kl for e in ends], cfg)
  kl_c = pool_trends([e.kl_correct for e in ends], cfg)
  reason = _reason((kl, kl_c), 0, None)
  if reason == "flat" and any(e.reason == "flat_under_lr_decay" for e in ends):
    reason = "flat_under_lr_decay"
  return EndState(reached=reason == "flat", reason=reason, kl=kl, kl_correct=kl_c, **common)


_MATCHED = ("step", "entropy_correct", "kl_correct", PRIMARY, "kl_mc")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Matched:
  """A run's measures where P(correct) first reaches a level (`matched_accuracy`; report.json's
  ``matched_accuracy_runs``): the ``step`` (interpolated), ``p_correct`` (the level itself, or the
  first measurement's when ``already_past``), the entropy over correct answers and the conditional,
  primary and Monte Carlo KLs there (nats); ``already_past``: the first measurement was already at
  or above the level (a match only in name)."""
  step: float
  p_correct: float
  entropy_correct: float
  kl_correct: float
  kl: float
  kl_mc: float
  already_past: bool

  def value(self, measure: str) -> float:
    """The measure named ``measure`` ('step', 'entropy_correct', 'kl_correct', 'kl', ...)."""
    return getattr(self, measure)


def matched_accuracy(series: Mapping[str, np.ndarray], levels: Sequence[float] = LEVELS
                     ) -> dict[str, Matched | None]:
  """Per level, the measures where P(correct) first reaches it (None if it never does).

  Between the last measurement below the level and the first at or above it, every measure is
  interpolated linearly in P(correct) to the level itself (``p_correct`` = the level). A run whose
  first measurement is already at or above the level has no measurement below it: its values are
  that measurement's, flagged ``already_past`` (a match only in name).

  Returns:
    level ('0.9') -> its `Matched` (``kl``: the primary KL) or None.
  """
  p = np.asarray(series["p_correct"], np.float64)
  out: dict[str, Matched | None] = {}
  for level in levels:
    hit = np.flatnonzero(p >= level)
    if not hit.size:
      out[f"{level:g}"] = None
      continue
    i = int(hit[0])
    frac = 1.0 if i == 0 else (level - p[i - 1]) / (p[i] - p[i - 1])
    at = lambda key: float(series[key][i] if i == 0 else
                           series[key][i - 1] + frac * (series[key][i] - series[key][i - 1]))
    vals = {k: at(k) for k in _MATCHED}
    out[f"{level:g}"] = Matched(step=vals["step"], p_correct=float(p[i]) if i == 0 else level,
                                entropy_correct=vals["entropy_correct"],
                                kl_correct=vals["kl_correct"], kl=vals[PRIMARY],
                                kl_mc=vals["kl_mc"], already_past=i == 0)
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
  for name, key, ylabel, log in (("kl_vs_step.png", PRIMARY, "KL(pi || pi~), decomposed (nats)",
                                  True),
                                 ("kl_correct_vs_step.png", CONDITIONAL,
                                  "KL(pi|correct || pi~|correct) (nats)", False)):
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for run, s in series.items():
      ax.plot(s["step"], s[key], label=run)
      if key == PRIMARY:
        band = 2 * np.asarray(s[PRIMARY_SE])
        ax.fill_between(s["step"], s[key] - band, s[key] + band, alpha=0.2)
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
