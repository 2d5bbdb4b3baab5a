"""The main job's report as an artifact: ``report.json`` read back into a `JobReport` (its claims as
`Claim`s), with an `artifacts.ArtifactError` naming the file and the field for a damaged one.
`pipeline.report.write_report` writes it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

from disa_jax import codec
from disa_jax.pipeline.anchor_study import SigmaStudy
from disa_jax.pipeline.dynamics import SeedEndState
from disa_jax.pipeline.report_records import (AnchorGap, Claim, Grid, MatchedSummary, Regime,
                                              Row, Stage1Section, Stage2Section)

@dataclasses.dataclass(frozen=True)
class JobReport:
  """The main job's report: what `write_report` (and `SumJob.run`) returns, loaded from
  ``<dir>/report.json``; ``report.md`` says it in words and tables.

  Each field is the report.json section of its name (the file has a few more: ``config``,
  ``instrument`` (how it decides: `instrument`), ``end_state_methods`` (each method's end state
  pooled over its seeds), ``matched_accuracy_runs``, ``run_seeds``). A row of ``methods`` / ``runs`` maps an evaluation
  metric (`eval_row`: ``kl_to_target``, ``accuracy_mean_at_k``, ...) to its value.

  Attributes:
    dir: the job's directory.
    methods: evaluation row per method (a Stage 3 method's: the mean over its seeds, with
      ``<metric>_std`` and ``seeds`` when there are several) and per other row (reference,
      proposal, lora_sft).
    runs: evaluation row per evaluated model (every Stage 3 seed its own).
    claims: the verdicts (`Claim`).
    skipped_methods: rows not trained -> why.
    regime: whether every method reached its end state (``all_at_end_state``, ``per_method``).
    stage1: the Stage 1 labels against the exact log Z (``n_study_mae_vs_exact``, ...; those
      figures only where the labels estimate it: `JobPlan.exact_on_label_scale`).
    stage2: the anchor's fit, and its sigma_g against the exact log Z
      (`JobPlan.exact_on_label_scale`).
    anchor_study: the sigma_g study of sharper anchors (None when off).
    nstudy: the App. C.3 study (None when off).
    anchor_gap: DISA against its oracle and Prop. 4 (None without both runs).
    end_state: per method, each seed's end-state verdict (`pipeline.dynamics.end_state`).
    matched_accuracy: per method, per accuracy level, mean ± std over seeds.
    conditional_kl: per row, the means of the preference among correct answers
      (`ConditionalKL.means`; None when the job did not compute them).
    grid: per method, its end-state figures over seeds and regime, and per regime KL against
      sigma_g (`_grid_section`, `disa_jax.pipeline.grid`; None in a report from before it).
    stage12_replicas: per Stage 1/2 data seed, the labels' error and the anchor's sigma_g ({}
      without further data seeds, and in a report from before them).
    stage3_seeds: the job's Stage 3 seeds.
    times_s: seconds per stage.
    plots: the PNG files in ``dir``.
  """
  dir: Path = codec.field(stored=False)
  methods: Mapping[str, Row]
  runs: Mapping[str, Row]
  claims: tuple[Claim, ...]
  skipped_methods: Mapping[str, str]
  regime: Regime
  stage1: Stage1Section
  stage2: Stage2Section
  anchor_study: SigmaStudy | None
  nstudy: Mapping[str, Any] | None
  anchor_gap: AnchorGap | None
  end_state: Mapping[str, tuple[SeedEndState, ...]]
  matched_accuracy: Mapping[str, Mapping[str, MatchedSummary]]
  conditional_kl: Mapping[str, Mapping[str, float]] | None = codec.field(omit=None)
  grid: Grid | None = codec.field(omit=None)
  stage12_replicas: Mapping[str, Mapping[str, float]] = codec.field(missing=lambda read: {})
  stage3_seeds: tuple[int, ...]
  times_s: Mapping[str, float]
  plots: tuple[str, ...]

  FILE = "report.json"

  @property
  def json_path(self) -> Path:
    return self.dir / self.FILE

  @property
  def md_path(self) -> Path:
    return self.dir / "report.md"

  def markdown(self) -> str:
    """The text of report.md."""
    return self.md_path.read_text()

  @classmethod
  def load(cls, workdir: str | Path) -> "JobReport":
    """The report of the job in ``workdir`` (`artifacts.ArtifactError` naming the file and the
    field when report.json is missing or malformed)."""
    return codec.load(cls, Path(workdir) / cls.FILE, "the main job's report", dir=Path(workdir))
