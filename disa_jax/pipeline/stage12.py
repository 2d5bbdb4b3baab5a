"""The report's Stage 1 and Stage 2 sections, against the exact partition function, and the report
of a job that runs Stages 1-2 alone (`MainConfig.stages` = 'anchor': `write_anchor_report`).

- `stage1_section`: the pool's statistics (ESS, CV^2, proposal accuracy), the N-study and, where
  the labels estimate the exact log Z (`JobPlan.exact_on_label_scale`), their errors against it;
- `stage2_section`: the anchor's fit against its labels and, on the sum scale, its sigma_g against
  the exact log Z (with ``generalisation`` on the prompts held out of the fit);
- `replicas_section`: the same figures per further Stage 1/2 data seed (`RunSpec.data_seed`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Mapping, Sequence

import jax
import numpy as np

from disa_jax import codec
from disa_jax import estimators as E
from disa_jax.anchor.diagnostics import generalisation, sigma_g
from disa_jax.anchor.labels import anchor_targets
from disa_jax.estimators.dataset import Stage1Data
from disa_jax.eval.exact import ExactTarget
from disa_jax.pipeline import claims as C
from disa_jax.pipeline.anchor_study import SigmaStudy
from disa_jax.pipeline import report_md as MD
from disa_jax.pipeline import seeds
from disa_jax.pipeline.plan import JobPlan
from disa_jax.pipeline.provenance import Provenance
from disa_jax.pipeline.report_records import Stage1Section, Stage2Section
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows.stage2 import AnchorArtifact

Replicas = Mapping[int, tuple[Stage1Data, AnchorArtifact]]  # data seed d > 0 -> its pool, anchor


def stage1_section(plan: JobPlan, pool: Stage1Data, exact: ExactTarget) -> Stage1Section:
  """Stage 1's pool against the exact log Z (report.json's ``stage1``)."""
  log_z = exact.log_z_of(pool.prompt_ids)
  study = E.n_study(jax.random.key(seeds.job_seed(plan.seed, "n_study")), pool.log_weights(),
                    pool.mask, ms=plan.n_study, repeats=plan.n_study_repeats, log_z_ref=log_z)
  n = plan.stage2_samples or pool.mask.shape[1]
  stats = E.stage1_statistics(pool.log_weights()[:, :n], pool.mask[:, :n])
  exact_figures = {}
  if plan.exact_on_label_scale:
    exact_figures = label_errors(plan, pool, exact) | {
        "n_study_mae_vs_exact": {str(m): float(np.nanmean(study.log_abs_error[i]))
                                 for i, m in enumerate(study.ms)},
        "n_disjoint_abs_error": C.stage1_disjoint_errors(
            np.asarray(pool.log_weights()), np.asarray(pool.mask), log_z, plan.n_study)}
  return Stage1Section(
      n=n, pool=int(pool.mask.shape[1]), label_scale=plan.label_scale,
      ess_median=float(np.nanmedian(np.asarray(stats["ess"]))),
      cv2_median=float(np.nanmedian(np.asarray(stats["cv2"]))),
      proposal_accuracy=float(pool.reward[pool.mask].mean()),
      prompts_without_correct_sample=int(np.sum((pool.reward[:, :n]
                                                 * pool.mask[:, :n]).max(1) == 0)),
      grade_errors=int(0 if pool.grade_error is None else pool.grade_error.sum()),
      n_study_variance={str(m): float(np.nanmean(study.variance[i]))
                        for i, m in enumerate(study.ms)},
      log_z_exact_mean=float(log_z.mean()), log_z_exact_std=float(log_z.std()), **exact_figures)


def label_errors(plan: JobPlan, pool: Stage1Data, exact: ExactTarget) -> dict[str, float]:
  """The labels Stage 2 fitted (each prompt's first ``stage2.samples`` samples) against the exact
  log Z: mean absolute and mean signed error."""
  labels, _ = anchor_targets(pool, samples=plan.stage2_samples or pool.mask.shape[1])
  err = labels - exact.log_z_of(pool.prompt_ids)
  return {"label_mae_vs_exact": float(np.mean(np.abs(err))),
          "label_signed_error_mean": float(np.mean(err))}


def stage2_section(plan: JobPlan, anchor: AnchorArtifact, pool: Stage1Data, exact: ExactTarget
                   ) -> Stage2Section:
  """The fit against its labels; on the sum scale also sigma_g against the exact log Z."""
  ids, emb = anchor.embeddings()
  val = [ids.index(p) for p in anchor.val_prompt_ids] or list(range(len(ids)))
  fs = anchor.fit
  out = Stage2Section(best_epoch=fs.best_epoch, val_mse_vs_labels=fs.val_mse,
                      val_r2_vs_labels=fs.val_r2, n_val=len(val),
                      val_mse_curve=tuple(anchor.history["val_mse"]))
  if plan.exact_on_label_scale:
    pred, log_z = np.asarray(anchor.anchor()(emb)), exact.log_z_of(ids)
    labels, _ = anchor_targets(pool, samples=plan.stage2_samples)
    gen = (_generalisation(plan, anchor, ids, pred, log_z)
           if plan.heldout.enabled and plan.heldout.anchor else None)
    out = dataclasses.replace(out, sigma_g_heldout=sigma_g(pred[val], log_z[val]),
                              sigma_g_all=sigma_g(pred, log_z),
                              label_rmse_heldout=sigma_g(labels[val], log_z[val]),
                              generalisation=gen)
  return out


def _generalisation(plan: JobPlan, anchor: AnchorArtifact, ids: Sequence[str], pred: np.ndarray,
                    log_z: np.ndarray) -> dict[str, dict[str, float]]:
  """The anchor against the exact log Z on the held-out prompts (never fitted: `HeldoutConfig`'s
  ``anchor``) and on the prompts it was fitted on, each beside the constant predictor of the
  fit's mean label."""
  held = {r.prompt_id for r in load_prompts(str(plan.heldout_prompts_path))}
  is_held = np.array([p in held for p in ids], bool)
  const = float(anchor.label_stats["mean"])
  return {"heldout": generalisation(pred[is_held], log_z[is_held], const),
          "fitted": generalisation(pred[~is_held], log_z[~is_held], const)}


def replicas_section(plan: JobPlan, replicas: Replicas, exact: ExactTarget,
                     s1: Stage1Section, s2: Stage2Section) -> dict[str, dict[str, float]]:
  """Per Stage 1/2 data seed ({} without further ones): the fit's best epoch and validation MSE
  and, on the sum scale, the labels' mean absolute error and the anchor's sigma_g against the exact
  log Z. Data seed 0's row is taken from the job's own Stage 1/2 sections ``s1`` / ``s2``."""
  if not replicas:
    return {}
  out = {"0": _replica_row(s1.label_mae_vs_exact, s2)}
  for d, (pool, anchor) in replicas.items():
    errors = label_errors(plan, pool, exact) if plan.exact_on_label_scale else {}
    out[str(d)] = _replica_row(errors.get("label_mae_vs_exact"),
                               stage2_section(plan, anchor, pool, exact))
  return out


def _replica_row(label_mae: float | None, fit: Stage2Section) -> dict[str, float]:
  """A data seed's row: the fit's best epoch and validation MSE, and the figures against the exact
  log Z that its scale has."""
  extra = {"label_mae_vs_exact": label_mae, "sigma_g_heldout": fit.sigma_g_heldout,
           "sigma_g_all": fit.sigma_g_all}
  return {"best_epoch": fit.best_epoch, "val_mse_vs_labels": fit.val_mse_vs_labels} | {
      k: v for k, v in extra.items() if v is not None}


@dataclasses.dataclass(frozen=True)
class AnchorReport:
  """Stages 1-2 of the job alone (`MainConfig.stages` = 'anchor'): ``anchor_report.json`` (the
  report's ``stage1`` / ``stage2`` sections, with ``generalisation`` where prompts are held out of
  the fit) and ``anchor_report.md``."""
  dir: Path
  stage1: Stage1Section
  stage2: Stage2Section

  def markdown(self) -> str:
    return (self.dir / "anchor_report.md").read_text()


def write_anchor_report(plan: JobPlan, pool: Stage1Data, anchor: AnchorArtifact,
                        exact: ExactTarget, *, anchor_study: SigmaStudy | None,
                        times: Mapping[str, float], provenance: Provenance
                        ) -> AnchorReport:
  """``anchor_report.json`` / ``.md`` in the job's directory: the Stage 1 and Stage 2 sections of
  `report.write_report`, computed the same way, the anchor study (`SumJob.anchor_study`; None
  when off), the times so far and the ``provenance`` (`pipeline.provenance`)."""
  s1 = stage1_section(plan, pool, exact)
  s2 = stage2_section(plan, anchor, pool, exact)
  out = codec.encode({"config": {"beta": plan.beta, "task": plan.task, "preset": plan.preset,
                                 "heldout": dataclasses.asdict(plan.heldout)},
                      "stage1": s1, "stage2": s2, "times_s": times,
                      "provenance": provenance})
  (plan.dir / "anchor_report.json").write_text(json.dumps(out, indent=1, default=float))
  md = [f"# DISA main job, Stages 1-2: sum task, {plan.task}, beta = {plan.beta}", "",
        f"Preset {plan.preset!r} (stages = 'anchor').", "",
        *MD.stage12_md(out["stage1"], out["stage2"], codec.encode(anchor_study)),
        *MD.times_md(times)]
  (plan.dir / "anchor_report.md").write_text("\n".join(md) + "\n")
  return AnchorReport(plan.dir, s1, s2)
