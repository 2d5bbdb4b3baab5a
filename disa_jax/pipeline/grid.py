"""The regime grid's figures (issue 27): per run, its end-state numbers over seeds; per regime, the
end-state KL against the anchor's error sigma_g beside the Prop. 4 envelope.

For every Stage 3 method of the job (`run_figures`), over its Stage 3 seeds:

- ``kl``: the final KL(pi || pi~), the primary one (`dynamics.PRIMARY`: the evaluation's exact
  decomposition with its one Monte Carlo term); ``kl_mc``: the plain Monte Carlo KL beside it;
- ``kl_correct``: the final conditional KL over correct answers, KL(pi|c || pi~|c) (exact);
- ``steps_to_0.9``: the step where P(correct) reaches 0.9, interpolated between measurements (the
  first measured step for a run already past it; `dynamics.matched_accuracy`), over the seeds that
  got there, and how many did;
- ``grad_sq``: the mean squared gradient norm over the end-state window (the last
  `dynamics.EndStateConfig.window` of the steps, before clipping). Near a stationary point the mean gradient is ~0, so this estimates the
  variance of the per-update gradient, tr Cov(g): the gradient noise a method trains with at its
  end state. It is comparable across log Z sources of one objective family (same residual scale),
  not across families (GRPO's loss has another scale);
  ``grad_sq_median`` is the median over the same steps: the squared norm is heavy-tailed (a few
  spiking steps can carry the mean), and the median says what a typical step sees;
- ``loss``: the mean training loss over the same window.

Each figure has its mean, sample std and a 95% Student-t interval over seeds (one seed: none).

`sigma_curve`: for the runs whose log Z has a known error (the exact log Z: 0; the exact log Z plus
noise of RMS sigma; the fitted anchor: its sigma_g against the exact log Z, on the sum scale only),
grouped by regime (residual scale, updates per rollout batch, staleness): sigma, the end-state KL
and the loss gap to the exact-log-Z run of the regime (first seeds) against Prop. 4's envelope
sigma^2 + 2 sigma sqrt(L_TB). The runs end at different policies, so the loss gap is between two training
runs' end-state losses, not the two losses at one policy that Prop. 4 bounds: the comparison is
read as a check, not a proof.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from disa_jax.pipeline import dynamics, seed_stats
from disa_jax.pipeline.claims import MatchedRuns, Row
from disa_jax.pipeline.plan import JobPlan
from disa_jax.pipeline.report_records import LEVEL_KEY, FigureSummary, RunFigures, SigmaPoint

WINDOW = dynamics.EndStateConfig.window  # the end-state window's default share of the steps
LEVEL = "0.9"  # the accuracy level of ``steps_to_0.9``


def summary(values: Sequence[float | None]) -> FigureSummary:
  """Mean, sample std and 95% Student-t interval of seed-level ``values`` (finite ones; ci95 None
  for one value, NaN mean and std for none)."""
  v = [x for x in values if x is not None and np.isfinite(x)]
  mean, std = dynamics.mean_std(v)  # (NaN for none, std 0 for one)
  if len(v) < 2:
    return FigureSummary(mean=mean, std=std, ci95=None, n=len(v))
  half = seed_stats.t_quantile(0.975, len(v) - 1) * std / math.sqrt(len(v))
  return FigureSummary(mean=mean, std=std, ci95=(mean - half, mean + half), n=len(v))


def window_means(rows: Sequence[Mapping[str, float]], total_steps: int,
                 window: float = WINDOW) -> dict[str, float]:
  """Mean and median squared ``grad_norm`` and mean ``loss`` of the training rows in the last ``window``
  of ``total_steps`` (rows without them, e.g. the exact measures' own rows, are skipped).

  Raises:
    ValueError: no training row in the window (the run did not get there).
  """
  start = total_steps - window * total_steps
  got = [(float(r["grad_norm"]), float(r["loss"])) for r in rows
         if "grad_norm" in r and "loss" in r and r.get("step", -1) > start]
  if not got:
    raise ValueError(f"no training row with grad_norm and loss after step {start:g} of "
                     f"{total_steps}")
  g, l = np.asarray(got).T
  return {"grad_sq": float(np.mean(g ** 2)), "grad_sq_median": float(np.median(g ** 2)),
          "loss": float(np.mean(l))}


@dataclasses.dataclass(frozen=True)
class SeedFigures:
  """One seed's end-state figures (`collect`; the module docstring says what each is).

  Attributes:
    seed: its Stage 3 seed.
    kl, kl_mc, kl_correct: the final evaluation's primary KL, Monte Carlo KL and conditional KL
      over correct answers.
    steps_to_level: the step where P(correct) reached `LEVEL` (None: it did not).
    grad_sq, grad_sq_median, loss: the end-state window's (`window_means`).
  """
  seed: int
  kl: float
  kl_mc: float
  kl_correct: float
  steps_to_level: float | None
  grad_sq: float
  grad_sq_median: float
  loss: float


_FIGURES = ("kl", "kl_mc", "kl_correct", "grad_sq", "grad_sq_median", "loss")


def run_figures(per_seed: Mapping[str, Sequence[SeedFigures]]) -> dict[str, RunFigures]:
  """Per method, `summary` of each figure over its seeds (the steps to `LEVEL`: over the seeds
  that reached it), and the first seed's window loss."""
  out = {}
  for m, seeds in per_seed.items():
    steps = [s.steps_to_level for s in seeds if s.steps_to_level is not None]
    out[m] = RunFigures(seeds=len(seeds), reached=len(steps), at_level={LEVEL_KEY: summary(steps)},
                        **{k: summary([getattr(s, k) for s in seeds]) for k in _FIGURES},
                        loss_first_seed=seeds[0].loss)
  return out


def collect(plan: JobPlan, stage3: Mapping, evals: Mapping[str, Row],
            matched_runs: Mapping[str, MatchedRuns]) -> dict[str, list[SeedFigures]]:
  """The seed-level figures of every Stage 3 method of the job (``plan``).

  Args:
    stage3: (method, seed) -> `Stage3Run`.
    evals: evaluation row name -> its row (`report.eval_row`).
    matched_runs: method -> [(seed, `dynamics.matched_accuracy`)], the report's dynamics.
  """
  out: dict[str, list[SeedFigures]] = {}
  for m, r in plan.runs.items():
    matched = dict(matched_runs.get(m, []))
    rows = []
    for seed, row in zip(r.seeds, r.rows):
      run, ev = stage3.get((m, seed)), evals.get(row)
      if run is None or ev is None or not Path(run.metrics_path).exists():
        continue
      hit = (matched.get(seed) or {}).get(LEVEL)
      rows.append(SeedFigures(
          seed=seed, kl=ev[dynamics.PRIMARY], kl_mc=ev["kl_to_target"], kl_correct=ev["kl_correct"],
          steps_to_level=None if hit is None else hit.step,
          **window_means(run.metrics(), r.total_steps, plan.end_state.window)))
    if rows:
      out[m] = rows
  return out


def sigma_of(plan: JobPlan, method: str, fitted_sigma_g: float | None,
             data_seed_sigma_g: Mapping[int, float] | None = None) -> float | None:
  """The RMS error of ``method``'s log Z against the exact one: 0 (exact), sigma (exact + noise),
  the fitted anchor's sigma_g (when the job's labels are on the sum scale): the job's
  (``fitted_sigma_g``) or, for a run on another Stage 1/2 data seed d, ``data_seed_sigma_g[d]``;
  None otherwise."""
  run = plan.runs[method]
  if not run.needs_anchor:
    return None
  if run.anchor == "exact":
    return 0.0
  if run.anchor == "exact+noise":
    return float(run.sigma)
  if not plan.exact_on_label_scale:
    return None
  return (data_seed_sigma_g or {}).get(run.data_seed) if run.data_seed else fitted_sigma_g


def sigma_curve(plan: JobPlan, figures: Mapping[str, RunFigures],
                fitted_sigma_g: float | None, data_seed_sigma_g: Mapping[int, float] | None = None
                ) -> dict[str, list[SigmaPoint]]:
  """Per regime (`Regime.label`) with an exact-log-Z run, its runs of known sigma sorted by sigma:
  KL (mean over the run's seeds), the loss gap |L - L_exact| of the end-state windows and Prop. 4's
  envelope sigma^2 + 2 sigma sqrt(L_exact). The losses are the first seed's of each run (every run
  has it, the one-seed cells only it): the gap pairs runs of one seed, and a seed of the exact run
  that diverged does not stand for the others."""
  by_regime: dict[str, list[tuple[float, str]]] = {}
  for m in figures:
    sigma = sigma_of(plan, m, fitted_sigma_g, data_seed_sigma_g)
    if sigma is not None:
      by_regime.setdefault(plan.runs[m].regime.label, []).append((sigma, m))
  out = {}
  for regime, pts in by_regime.items():
    exact = [m for s, m in pts if s == 0.0]
    if not exact:
      continue
    l_tb = figures[exact[0]].loss_first_seed
    out[regime] = [SigmaPoint(run=m, sigma=s, kl=figures[m].kl.mean, kl_std=figures[m].kl.std,
                              seeds=figures[m].seeds,
                              loss_gap=abs(figures[m].loss_first_seed - l_tb),
                              envelope=s * s + 2.0 * s * math.sqrt(max(l_tb, 0.0)))
                   for s, m in sorted(pts)]
  return out


def plot_sigma_curve(curve: Mapping[str, Sequence[SigmaPoint]], out_dir: str | Path
                     ) -> list[str]:
  """kl_vs_sigma.png: end-state KL against sigma per regime, and the loss gap against the envelope
  (log scale); [] when no regime has a curve."""
  if not curve:
    return []
  import matplotlib  # pylint: disable=g-import-not-at-top  (heavy import, plots only)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (heavy import)
  fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
  for regime, pts in curve.items():
    s = [p.sigma for p in pts]
    ax.plot(s, [p.kl for p in pts], marker="o", label=regime)  # (the table has the spread)
    line = bx.plot(s, [max(p.loss_gap, 1e-3) for p in pts], marker="o", label=f"{regime}: gap")
    bx.plot(s, [max(p.envelope, 1e-3) for p in pts], ls="--", color=line[0].get_color(),
            label=f"{regime}: envelope")
  ax.set_yscale("log")  # (a diverged seed puts a mean two decades above the rest)
  ax.set_xlabel("sigma_g (RMS error of log Z)"); ax.set_ylabel("end-state KL(pi || pi~), mean")
  ax.set_title("KL against the anchor's error"); ax.legend(fontsize=7)
  bx.set_yscale("log"); bx.set_xlabel("sigma_g"); bx.set_ylabel("|L - L_exact| (end-state window)")
  bx.set_title("loss gap and Prop. 4 envelope"); bx.legend(fontsize=6)
  fig.tight_layout(); fig.savefig(Path(out_dir) / "kl_vs_sigma.png", dpi=110); plt.close(fig)
  return ["kl_vs_sigma.png"]
