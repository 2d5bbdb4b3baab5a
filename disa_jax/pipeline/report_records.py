"""The records of report.json's sections that more than one module reads (`pipeline.report` writes
them, `JobReport` and `pipeline.tables` read them back): the claims, the regime, the grid of
end-state figures, the instrument and the job's config line. Each is a frozen dataclass stored by
`codec` (its JSON keys in the order of its fields); a field added since a report was written has a
default, so that older reports load."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from disa_jax import codec
from disa_jax.anchor.diagnostics import Prop4Check

Row = Mapping[str, float]  # an evaluation row: metric -> value (`report.eval_row`; k, seeds: counts)


def split_comparison(entry: str) -> tuple[str, str] | None:
  """A comparison as a design spells it, 'A:B' (two different runs, neither empty nor holding
  ':'), as (A, B); None when ``entry`` is not spelt so (the caller names its field)."""
  a, sep, b = entry.partition(":")
  if not sep or not a or not b or a == b or ":" in b:
    return None
  return a, b


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClaimTest:
  """The test a claim is decided by (`pipeline.claims`; a claim's ``test`` in report.json).

  Attributes:
    name: 'welch' | 'tost' | 'fisher' | 'paired_t'.
    p: its raw p-value.
    direction_ok: the difference has the claimed sign.
    summary: the test in words (difference, interval, seeds).
    p_holm: its p-value Holm-adjusted over the report's tests (None until `claims.finalise`).
  """
  name: str
  p: float
  direction_ok: bool
  summary: str
  p_holm: float | None = codec.field(default=None, omit=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Claim:
  """One verdict of the report (`pipeline.claims`; report.json's ``claims`` entries, its keys in
  the order of the fields).

  Attributes:
    claim: what is claimed, in words.
    numbers: the numbers it is decided on (means in nats, the test's statistics, seeds, failed
      runs, ...: a different set per kind of claim, stored as they are).
    runs: the Stage 3 methods it compares (() for a claim about Stage 1).
    test: the test deciding it (None: untested, or an older report).
    why: why it does not hold or is undecided (None: no reason to give).
    state: 'end state' | 'transient' | 'undecided' | '-' (no runs); '' in an older report.
    from_transient: some of ``runs`` were not shown to be at their end state.
    verdict: 'holds' | 'does not hold' | 'undecided' ('' until `claims.finalise`; a report from
      before issue 44, without it: 'holds' / 'does NOT hold', from ``holds``).
    holds: whether the numbers support it (``verdict == 'holds'``).
  """
  claim: str
  numbers: Mapping[str, Any]
  runs: tuple[str, ...]
  test: ClaimTest | None = None
  why: str | None
  state: str = ""
  from_transient: bool
  verdict: str = ""
  holds: bool = codec.field(default=False, required=True)

  def __post_init__(self):
    if not self.verdict and not self.state:  # (a report from before issue 44)
      object.__setattr__(self, "verdict", "holds" if self.holds else "does NOT hold")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EndpointTest:
  """One declared test of the ``endpoints`` section (`endpoints.section`; `family` reads them): A - B (``a``, ``b``) on ``endpoint`` over
  prompt set ``set``; the raw and Holm p-values (None: not run), the difference (KL: nats; a
  Gehan test: minus its effect, in [-1, 1]) and its 95% interval (Welch only), the seeds a side
  (``n_a``, ``n_b``), the ``method`` ('welch' | 'gehan'; None in a report from before issue 62),
  a Gehan test's censoring ``kinds`` per side and ``splits``, and the ``verdict`` in words."""
  a: str
  b: str
  endpoint: str
  set: str
  p: float | None = None
  p_holm: float | None = None
  diff: float | None = None
  ci_low: float | None = None
  ci_high: float | None = None
  n_a: int
  n_b: int
  method: str | None = codec.field(default=None, omit=None)
  kinds: tuple[Mapping[str, int], ...] | None = codec.field(default=None, omit=None)
  splits: int | None = codec.field(default=None, omit=None)
  verdict: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Regime:
  """Whether every method reached its end state (report.json's ``regime``): the ``preset``, its
  Stage 3 ``steps``, ``all_at_end_state`` and each method's state in words (``per_method``)."""
  preset: str = ""
  steps: int = 0
  all_at_end_state: bool = False
  per_method: Mapping[str, str]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FigureSummary:
  """A figure over a run's seeds (`grid.summary`): ``mean``, sample ``std``, the 95% Student-t
  interval ``ci95`` (None for one value) and the number ``n`` of finite values (NaN mean for 0)."""
  mean: float
  std: float
  ci95: tuple[float, float] | None
  n: int


LEVEL_KEY = "steps_to_0.9"  # `RunFigures`' steps to P(correct) 0.9, one key of report.json


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFigures:
  """One method's end-state figures over its seeds (`grid.run_figures`): ``seeds``, how many
  ``reached`` P(correct) 0.9 and the steps they took (``steps_to_0.9``, in ``at_level``); the
  primary and the Monte Carlo KL and the conditional KL over correct answers (nats), the squared
  gradient norm's mean and median and the loss over the end-state window, and the first seed's
  window loss."""
  seeds: int
  reached: int
  at_level: Mapping[str, FigureSummary] = codec.field(inline=True, keys=(LEVEL_KEY,))
  kl: FigureSummary
  kl_mc: FigureSummary | None = None
  kl_correct: FigureSummary
  grad_sq: FigureSummary
  grad_sq_median: FigureSummary
  loss: FigureSummary | None = None
  loss_first_seed: float | None = None

  @property
  def steps_to_level(self) -> FigureSummary:
    return self.at_level[LEVEL_KEY]

  def figure(self, name: str) -> FigureSummary:
    return getattr(self, name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SigmaPoint:
  """One run of a regime's KL-against-sigma_g curve (`grid.sigma_curve`): its ``sigma`` (the RMS
  error of its log Z), KL mean and std over its ``seeds``, the loss gap to the exact-log-Z run and
  Prop. 4's envelope."""
  run: str
  sigma: float
  kl: float
  kl_std: float
  seeds: int
  loss_gap: float
  envelope: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Grid:
  """report.json's ``grid``: per method its regime in words and `RunFigures`, per regime its
  `SigmaPoint`s (sorted by sigma)."""
  regimes: Mapping[str, str]
  figures: Mapping[str, RunFigures]
  sigma_curve: Mapping[str, tuple[SigmaPoint, ...]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
  """report.json's ``config``: the few config values the report prints."""
  beta: float
  task: str
  engine: str = ""
  stage3_steps: int
  preset: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Instrument:
  """How a report decides (report.json's ``instrument``, `report.instrument`; a report from before
  issue 44 has none): the primary KL every verdict uses and the one shown ``beside`` it, the
  claims' ``alpha`` and ``correction``, the end-state rule (`dynamics.EndStateConfig`'s fields),
  the failure thresholds (`claims`), the endpoints' tests, Prop. 4's status and the seeds."""
  primary_metric: str
  beside: str = ""
  alpha: float = 0.05
  correction: str = ""
  end_state: Mapping[str, float] = codec.field(default_factory=dict)
  collapse_entropy_fraction: float | None = None
  divergence_factor: float | None = None
  endpoint_tests: Mapping[str, str] | None = codec.field(default=None, omit=None)
  prop4: str | None = codec.field(default=None, omit=None)
  seeds: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MatchedSummary:
  """A method at one accuracy level (report.json's ``matched_accuracy[method][level]``,
  `report._matched_summary`): (mean, std) over the seeds interpolated to the level of the step,
  the entropy over correct answers, the conditional KL over them and the primary KL (nats); the
  seeds interpolated there, those already past it at their first measurement, and the number of
  seeds."""
  step: tuple[float, float]
  entropy_correct: tuple[float, float]
  kl_correct: tuple[float, float]
  kl: tuple[float, float]
  seeds_reached: tuple[int, ...]
  seeds_already_past: tuple[int, ...]
  seeds: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prop4Numbers:
  """Prop. 4 as numbers, never a verdict (`report.prop4_numbers`): `Prop4Check`'s numbers (its
  ``verdict`` None), why there is no verdict (``verdict_why``) and the loss gap's share of the
  held-out envelope (``gap_over_envelope``; NaN without held-out prompts)."""
  check: Prop4Check = codec.field(inline=True)
  verdict_why: str
  gap_over_envelope: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnchorGap:
  """DISA with its fitted anchor against its oracle on the exact log Z (report.json's
  ``anchor_gap``, `report._anchor_gap`): their primary KL (``kl_metric``, nats) and its gap, and
  Prop. 4 as numbers at DISA's final policy."""
  kl_disa: float
  kl_disa_exact: float
  kl_gap: float
  kl_metric: str
  prop4: Prop4Numbers = codec.field(inline=True)


def _unset():
  """A figure recorded only where the labels estimate the exact log Z (the sum scale): None, and
  not stored, elsewhere."""
  return codec.field(default=None, omit=None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Section:
  """Stage 1's pool against the exact log Z (report.json's ``stage1``, `stage12.stage1_section`).

  Attributes:
    n: the samples per prompt of the labels (the first ``n`` of the pool's ``pool``).
    label_scale: 'sum' | 'mean'.
    ess_median, cv2_median: the importance weights' median ESS and CV^2 over prompts.
    proposal_accuracy: the proposal's P(correct) over the pool.
    prompts_without_correct_sample, grade_errors: counts.
    n_study_variance: N -> mean Var(log Z_N) over prompts (nats^2).
    log_z_exact_mean, log_z_exact_std: the exact log Z across prompts (nats).
    label_mae_vs_exact, label_signed_error_mean: the labels against the exact log Z (nats; the sum
      scale only, like the next two).
    n_study_mae_vs_exact: N -> mean |log Z_N - log Z| over prompts.
    n_disjoint_abs_error: N -> ``[P]`` errors, each N from its own samples
      (`claims.stage1_disjoint_errors`; {} when fewer than two N fit).
  """
  n: int
  pool: int
  label_scale: str
  ess_median: float
  cv2_median: float
  proposal_accuracy: float
  prompts_without_correct_sample: int
  grade_errors: int
  n_study_variance: Mapping[str, float]
  log_z_exact_mean: float
  log_z_exact_std: float
  label_mae_vs_exact: float | None = _unset()
  label_signed_error_mean: float | None = _unset()
  n_study_mae_vs_exact: Mapping[str, float] | None = _unset()
  n_disjoint_abs_error: Mapping[str, tuple[float, ...]] | None = _unset()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage2Section:
  """The anchor's fit (report.json's ``stage2``, `stage12.stage2_section`): its best epoch,
  validation MSE and R^2 against its labels over ``n_val`` prompts, the validation MSE per epoch
  (``val_mse_curve``: plotted, not stored); on the sum scale its sigma_g against the exact log Z
  on the held-out and on all prompts, the raw labels' RMS error on the held-out ones (nats), and,
  with prompts held out of the fit, the anchor on them and on the fitted ones beside the constant
  predictor (``generalisation``: 'heldout' / 'fitted' -> `anchor.diagnostics.generalisation`)."""
  best_epoch: int
  val_mse_vs_labels: float | None
  val_r2_vs_labels: float | None
  n_val: int
  val_mse_curve: tuple[float, ...] = codec.field(default=(), stored=False)
  sigma_g_heldout: float | None = _unset()
  sigma_g_all: float | None = _unset()
  label_rmse_heldout: float | None = _unset()
  generalisation: Mapping[str, Mapping[str, float]] | None = _unset()
