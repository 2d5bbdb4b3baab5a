"""The main job's report: report.json, report.md and PNG plots, with the paper's claims checked.

Everything is measured against the exact partition function of the sum task (`disa_jax.eval.exact`):
Stage 3 logs the exact measures every ``track.every`` steps (`pipeline.dynamics`), and the final
policies are evaluated with more samples. Every verdict uses one KL, the primary
``kl_decomposed`` (the exact decomposition with its one Monte Carlo term); the plain Monte Carlo
KL (``kl_to_target``, ``kl_mc``) is shown beside it. The claims are built in `pipeline.claims`
(Stage 1's error against N on independent draws, the fix and DISA as close to pi~ as the oracle
by an equivalence test, their KL below the reward maximisers' and the controls', the configured
pairs; failures counted by Fisher's exact test, KL compared by Welch's test over the runs that did
not fail, Holm's correction over the report's tests; "undecided" where nothing could be tested).
Prop. 4 is reported as numbers (sigma_g, L_TB, L_DISA, the envelope), with a verdict only where its
two sides are estimated on disjoint prompts and the envelope is tighter than L_TB itself.

Each claim is flagged with the end state of the methods it compares: a method is at its end state
when the primary KL and the conditional KL over correct answers are flat within an equivalence
margin over the end-state window, pooled over its seeds (`dynamics.method_end_state`;
`MainConfig.end_state`). With several Stage 3 seeds a method's row is the mean over seeds (``*_std``
the standard deviation). The tables README / docs print come from report.json through
`pipeline.tables`. `write_report` returns the report as a `JobReport` (read back from report.json);
with `MainConfig.conditional_kl` it has a ``conditional_kl`` section and report.md the table
"Preference among correct answers" (`pipeline.conditional_kls`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import jax
import numpy as np

from disa_jax import artifacts
from disa_jax import estimators as E
from disa_jax.anchor.diagnostics import generalisation, prop4_check, sigma_g
from disa_jax.anchor.labels import anchor_targets
from disa_jax.data import loaders
from disa_jax.estimators.dataset import Stage1Data
from disa_jax.eval.exact import ExactTarget
from disa_jax.pipeline import dynamics as D
from disa_jax.pipeline import endpoints as EP
from disa_jax.pipeline import grid as G
from disa_jax.pipeline import claims as C
from disa_jax.pipeline import seeds, tables
from disa_jax.pipeline.anchor_study import format_sigma_table
from disa_jax.pipeline.conditional_kls import ConditionalKLs
from disa_jax.workflows.evaluation import BenchmarkEval, EvalResult
from disa_jax.workflows.nstudy import NStudyResult
from disa_jax.workflows.stage2 import AnchorArtifact
from disa_jax.workflows.stage3 import Stage3Run

if TYPE_CHECKING:  # (sum_job imports this module: the job's type for annotations only)
  from disa_jax.pipeline.sum_job import SumJob

TASK = "task"  # the evaluations' benchmark of the job's prompts
Stage3Runs = Mapping[tuple[str, int], Stage3Run]  # every Stage 3 run, by (method, seed)


def exact_on_label_scale(job: SumJob) -> bool:
  """Whether the Stage 1 labels estimate the exact log Z (the trajectory sum's: label_scale 'sum').
  On the mean scale (1/|o|) they estimate another quantity that no enumeration gives, so the report
  prints no error against the exact value for them, nor for the anchor fitted to them."""
  return job.cfg.stage1.label_scale == "sum"


def _stage1_section(job: SumJob, pool: Stage1Data, exact: ExactTarget) -> dict[str, Any]:
  log_z = exact.log_z_of(pool.prompt_ids)
  study = E.n_study(jax.random.key(seeds.job_seed(job.cfg.seed, "n_study")), pool.log_weights(),
                    pool.mask, ms=job.cfg.n_study,
                    repeats=job.cfg.n_study_repeats, log_z_ref=log_z)
  n = job.stage2_cfg.samples or pool.mask.shape[1]
  stats = E.stage1_statistics(pool.log_weights()[:, :n], pool.mask[:, :n])
  out = {
      "n": n, "pool": int(pool.mask.shape[1]), "label_scale": job.cfg.stage1.label_scale,
      "ess_median": float(np.nanmedian(np.asarray(stats["ess"]))),
      "cv2_median": float(np.nanmedian(np.asarray(stats["cv2"]))),
      "proposal_accuracy": float(pool.reward[pool.mask].mean()),
      "prompts_without_correct_sample": int(np.sum((pool.reward[:, :n] * pool.mask[:, :n]).max(1) == 0)),
      "grade_errors": int(0 if pool.grade_error is None else pool.grade_error.sum()),
      "n_study_variance": {str(m): float(np.nanmean(study.variance[i])) for i, m in enumerate(study.ms)},
      "log_z_exact_mean": float(log_z.mean()), "log_z_exact_std": float(log_z.std()),
  }
  if exact_on_label_scale(job):
    out |= _label_errors(job, pool, exact) | {
        "n_study_mae_vs_exact": {str(m): float(np.nanmean(study.log_abs_error[i]))
                                 for i, m in enumerate(study.ms)},
        "n_disjoint_abs_error": C.stage1_disjoint_errors(
            np.asarray(pool.log_weights()), np.asarray(pool.mask), log_z, job.cfg.n_study)}
  return out


def _label_errors(job: SumJob, pool: Stage1Data, exact: ExactTarget) -> dict[str, float]:
  """The labels Stage 2 fitted (each prompt's first ``stage2.samples`` samples) against the exact
  log Z: mean absolute and mean signed error."""
  labels, _ = anchor_targets(pool, samples=job.stage2_cfg.samples or pool.mask.shape[1])
  err = labels - exact.log_z_of(pool.prompt_ids)
  return {"label_mae_vs_exact": float(np.mean(np.abs(err))),
          "label_signed_error_mean": float(np.mean(err))}


def _stage2_section(job: SumJob, anchor: AnchorArtifact, pool: Stage1Data, exact: ExactTarget
                    ) -> dict[str, Any]:
  """The fit against its labels; on the sum scale also sigma_g against the exact log Z."""
  ids, emb = anchor.embeddings()
  val = [ids.index(p) for p in anchor.val_prompt_ids] or list(range(len(ids)))
  fs = anchor.fit
  out = {"best_epoch": fs.best_epoch, "val_mse_vs_labels": fs.val_mse, "val_r2_vs_labels": fs.val_r2,
         "n_val": len(val), "val_mse_curve": anchor.history["val_mse"]}
  if exact_on_label_scale(job):
    pred, log_z = np.asarray(anchor.anchor()(emb)), exact.log_z_of(ids)
    labels, _ = anchor_targets(pool, samples=job.stage2_cfg.samples)
    out |= {"sigma_g_heldout": sigma_g(pred[val], log_z[val]), "sigma_g_all": sigma_g(pred, log_z),
            "label_rmse_heldout": sigma_g(labels[val], log_z[val])}
    if job.cfg.heldout.enabled and job.cfg.heldout.anchor:
      out["generalisation"] = _generalisation(job, anchor, ids, pred, log_z)
  return out


def _generalisation(job: SumJob, anchor: AnchorArtifact, ids: Sequence[str], pred: np.ndarray,
                    log_z: np.ndarray) -> dict[str, dict[str, float]]:
  """The anchor against the exact log Z on the held-out prompts (never fitted: `HeldoutConfig`'s
  ``anchor``) and on the prompts it was fitted on, each beside the constant predictor of the
  fit's mean label."""
  held = {r.prompt_id for r in loaders.load_prompts(job.heldout_prompts_path)}
  is_held = np.array([p in held for p in ids], bool)
  const = float(anchor.label_stats["mean"])
  return {"heldout": generalisation(pred[is_held], log_z[is_held], const),
          "fitted": generalisation(pred[~is_held], log_z[~is_held], const)}


def _replicas_section(job: SumJob, inputs: ReportInputs, s1: Mapping[str, Any],
                      s2: Mapping[str, Any]) -> dict[str, dict[str, float]]:
  """Per Stage 1/2 data seed ({} without further ones): the fit's best epoch and validation MSE
  and, on the sum scale, the labels' mean absolute error and the anchor's sigma_g against the exact
  log Z. Data seed 0's row is taken from the job's own Stage 1/2 sections ``s1`` / ``s2``."""
  if not inputs.replicas:
    return {}
  keys = ("label_mae_vs_exact", "sigma_g_heldout", "sigma_g_all")
  row = lambda errors, fit: {"best_epoch": fit["best_epoch"],
                             "val_mse_vs_labels": fit["val_mse_vs_labels"]} | {
                                 k: src[k] for src in (errors, fit) for k in keys if k in src}
  out = {"0": row(s1, s2)}
  for d, (pool, anchor) in inputs.replicas.items():
    errors = _label_errors(job, pool, inputs.exact) if exact_on_label_scale(job) else {}
    out[str(d)] = row(errors, _stage2_section(job, anchor, pool, inputs.exact))
  return out


def _replicas_md(section: Mapping[str, Mapping[str, float]]) -> list[str]:
  if not section:
    return []
  return ["## Stage 1/2 data seeds", "",
          "Stage 1 drawn again (sampling seed + d) and Stage 2 fitted on it (fit seed + d); the runs "
          "named `*_data<d>` read that anchor and replay pool.", "",
          *tables.replicas_table({"stage12_replicas": section}), ""]


def eval_row(task: BenchmarkEval) -> dict[str, Any]:
  """A report row from an evaluation's task benchmark (sampled metrics and the exact target)."""
  k, m, x = task.k, task.metrics, task.exact
  if x is None:
    raise ValueError(f"the evaluation of {task.method!r} on {task.path} has no exact measures "
                     "(exact_target off)")
  return {"k": k, "accuracy_mean_at_k": m[f"mean@{k}"], "pass_at_k": m[f"pass@{k}"],
          "distinct_correct_mean": m[f"distinct_correct@{k}"], "p_correct_exact": x["p_correct"],
          "entropy_correct": x["entropy_correct"], "target_entropy_correct": x["target_entropy_correct"],
          "kl_to_target": x["kl_mc"], "kl_to_target_se": x["kl_mc_se"],
          "kl_binary": x["kl_binary"], "kl_correct": x["kl_correct"],
          "p_correct_kl_correct": x["p_correct_kl_correct"], "p_wrong_kl_wrong": x["p_wrong_kl_wrong"],
          "kl_decomposed": x["kl_decomposed"], "kl_decomposed_se": x["kl_decomposed_se"]}


AGGREGATED = ("accuracy_mean_at_k", "pass_at_k", "distinct_correct_mean", "p_correct_exact", "entropy_correct",
              "kl_to_target", "kl_binary", "kl_correct", "p_correct_kl_correct", "p_wrong_kl_wrong",
              "kl_decomposed")


def aggregate_seeds(job: SumJob, evals: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
  """Evaluation rows by method: the mean over the method's Stage 3 seeds, with ``<metric>_std`` and ``seeds``
  when there are several; rows that are not Stage 3 runs (reference, proposal, lora_sft) as they are."""
  runs = {m: [job.run_name(m, s) for s in job.cfg.run_seeds(m)] for m in job.cfg.methods}
  in_runs = {r for rs in runs.values() for r in rs}
  out = {name: e for name, e in evals.items() if name not in in_runs and name in ("reference", "proposal")}
  for m, names in runs.items():
    rows = [evals[n] for n in names if n in evals]
    if not rows:
      continue
    if len(rows) == 1:
      out[m] = rows[0]
      continue
    agg = dict(rows[0])
    for k in AGGREGATED + ("kl_to_target_se", "kl_decomposed_se"):
      vals = np.asarray([r[k] for r in rows], np.float64)
      agg[k] = float(vals.mean())
      agg[f"{k}_std"] = float(vals.std(ddof=1))
    agg["seeds"] = len(rows)
    out[m] = agg
  out.update({name: e for name, e in evals.items() if name not in in_runs and name not in out})
  return out


def _training_curves(job: SumJob, stage3: Stage3Runs) -> dict[str, list[tuple[int, float]]]:
  curves = {}
  for m in job.cfg.methods:  # the first seed's run
    run = stage3.get((m, job.cfg.run_seeds(m)[0]))
    if run is not None and run.metrics_path.exists():
      curves[m] = [(int(r["step"]), float(r["reward"])) for r in run.metrics() if "reward" in r]
  return curves


def _plots(job: SumJob, s1: dict[str, Any], s2: dict[str, Any],
           curves: dict[str, list[tuple[int, float]]]) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top  (heavy import, plots only)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (heavy import)
  files = []
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for m, pts in curves.items():
    if pts:
      st, rw = zip(*pts)
      w = max(1, len(rw) // 20)
      ax.plot(st[w - 1:], np.convolve(rw, np.ones(w) / w, mode="valid"), label=m)  # trailing moving average
  ax.set_xlabel("RL step"); ax.set_ylabel("train reward (moving average)"); ax.legend(); ax.set_title("Stage 3")
  fig.tight_layout(); fig.savefig(job.dir / "training_curves.png", dpi=110); plt.close(fig)
  files.append("training_curves.png")
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  key, title = (("n_study_mae_vs_exact", "mean |log Z_IS - log Z|") if "n_study_mae_vs_exact" in s1
                else ("n_study_variance", "mean Var(log Z_N) (no exact value on this scale)"))
  axes[0].plot([int(m) for m in s1[key]], list(s1[key].values()), marker="o")
  axes[0].set_xscale("log", base=2); axes[0].set_xlabel("N"); axes[0].set_title(title)
  if s2["val_mse_curve"]:
    axes[1].plot(s2["val_mse_curve"]); axes[1].set_xlabel("epoch"); axes[1].set_title("Stage 2 val MSE")
  fig.tight_layout(); fig.savefig(job.dir / "stage1_stage2.png", dpi=110); plt.close(fig)
  files.append("stage1_stage2.png")
  return files


def _lr_decay_step(job: SumJob, method: str, seed: int) -> int | None:
  """The first RL step of (method, seed)'s learning-rate decay phase (None: a constant rate)."""
  t = job.stage3_cfgs[(method, seed)].train
  return D.lr_decay_step(t.total_steps, t.rollout.num_minibatches, t.optim.decay_frac)


def _dynamics(job: SumJob, stage3: Stage3Runs) -> dict[str, Any]:
  """Per method: each seed's end state and matched accuracy, the method's end state pooled over
  its seeds (``method_state``), and the first seed's series."""
  out: dict[str, Any] = {"series": {}, "end_state": {}, "method_state": {}, "matched": {},
                         "matched_runs": {}}
  cfg = job.cfg.end_state
  for m in job.cfg.methods:
    ends, matched = [], []
    for seed in job.cfg.run_seeds(m):
      run = stage3.get((m, seed))
      series = run.exact_series() if run is not None and run.metrics_path.exists() else None
      if series is None or series["step"].size < 2:
        continue
      if seed == job.cfg.run_seeds(m)[0]:
        out["series"][m] = series
      ends.append((seed, D.end_state(series, cfg, lr_decay_step=_lr_decay_step(job, m, seed))))
      matched.append((seed, D.matched_accuracy(series)))
    if ends:
      out["end_state"][m] = [e.to_dict() | {"seed": seed} for seed, e in ends]
      out["method_state"][m] = D.method_end_state([e for _, e in ends], cfg).to_dict()
      out["matched_runs"][m] = matched
      out["matched"][m] = {lvl: _matched_summary(matched, lvl) for lvl in (f"{v:g}" for v in D.LEVELS)}
  return out


def _matched_summary(matched: list[tuple[int, dict]], lvl: str) -> dict[str, Any]:
  """Mean and std over the seeds interpolated to ``lvl`` (not those already past it at their first
  measurement, listed apart)."""
  got = [(s, x[lvl]) for s, x in matched if x[lvl] is not None]
  inside = [v for _, v in got if not v["already_past"]]
  return {k: D.mean_std([v[k] for v in inside]) for k in ("step", "entropy_correct", "kl_correct", "kl")
          } | {"seeds_reached": [s for s, v in got if not v["already_past"]],
               "seeds_already_past": [s for s, v in got if v["already_past"]], "seeds": len(matched)}


def _state_label(dyn: dict, m: str) -> tuple[bool, str]:
  """(``m`` is at its end state pooled over its seeds, the state in words)."""
  state = dyn["method_state"].get(m)
  if state is None:
    return False, "undecided (no exact measurements)"
  return state["reached"], state["label"]


def _claims(job: SumJob, s1: dict[str, Any], runs: dict[str, dict[str, Any]], dyn: dict[str, Any],
            fix: str | None, contrasts: list[str]) -> list[dict[str, Any]]:
  """The paper's claims on this task (`pipeline.claims`); ``contrasts`` are the reward-maximising
  runs they are compared with, ``job.cfg.controls`` the controls the fix is compared with."""
  seed_rows = {m: [(s, runs[job.run_name(m, s)]) for s in job.cfg.run_seeds(m)
                   if job.run_name(m, s) in runs] for m in job.cfg.methods}
  ref = runs.get("reference")
  ev = C.Evidence(seed_rows=seed_rows, dyn=dyn, end_state=job.cfg.end_state,
                  reference_kl=None if ref is None else ref[D.PRIMARY])
  replay = tuple((m, m[:-len("_replay")]) for m in job.cfg.methods
                 if m.endswith("_replay") and m[:-len("_replay")] in job.cfg.methods)
  plan = C.Plan(fix=fix or "", contrasts=tuple(contrasts), controls=tuple(job.cfg.controls),
                compare=tuple(job.cfg.compare), replay=replay)
  return C.build_claims(ev, plan, s1.get("n_disjoint_abs_error") if exact_on_label_scale(job) else None)


def _anchor_gap(evals: dict[str, dict[str, Any]], results: Mapping[str, EvalResult],
                anchor: AnchorArtifact, exact: ExactTarget) -> dict[str, Any] | None:
  """DISA with the fitted anchor against the oracle (exact log Z; the primary KL), and Prop. 4 as a
  measurement (`anchor.diagnostics.prop4_check`): the loss gap from the anchor's training prompts,
  the envelope from its held-out prompts. A verdict only where the envelope is below L_TB itself:
  an envelope at or above the loss bounds the gap by more than the loss, a check that can hardly
  fail (``verdict`` None, ``verdict_why`` says so)."""
  if not {"disa", "disa_exact"} <= set(evals) or "disa" not in results:
    return None
  g = anchor.predictions()
  held = set(anchor.val_prompt_ids)
  log_z = exact.log_z_by_id()
  task = results["disa"].benchmarks[TASK]
  pids = task.prompt_ids
  eta = np.asarray([g[p] - log_z[p] for p in pids])
  r_mean, r_sq = task.exact.per_prompt_values("kl_mc"), task.exact.per_prompt_values("tb_sq")
  is_held = np.asarray([p in held for p in pids])
  check = prop4_verdict(dataclasses.asdict(prop4_check(eta[~is_held], r_mean[~is_held],
                                                        r_sq[~is_held], eta[is_held])))
  kl = lambda m: evals[m][D.PRIMARY]
  return {"kl_disa": kl("disa"), "kl_disa_exact": kl("disa_exact"),
          "kl_gap": kl("disa") - kl("disa_exact"), "kl_metric": D.PRIMARY, **check}


def prop4_verdict(check: dict[str, Any]) -> dict[str, Any]:
  """`prop4_check`'s numbers (as a dict) with its verdict kept only where the held-out envelope
  is below L_TB (else None), and ``verdict_why`` saying why there is none."""
  why = None
  if check["verdict"] is None:
    why = "no held-out prompts, so no independent check"
  elif not check["envelope"] < check["loss_tb"]:
    why = (f"the envelope {check['envelope']:.4f} is not below L_TB = {check['loss_tb']:.4f}: the "
           "bound is looser than the loss itself")
  return check | {"verdict": None if why else check["verdict"], "verdict_why": why}


def _anchor_study_md(res: dict | None) -> list[str]:
  if res is None:  # the study is off (stage2.study_repeats = 0)
    return []
  return ["## Sharper anchors? sigma_g against the exact log Z (issue 9)", "",
          f"Held-out sigma_g = RMS(g(q) - log Z(q)), {res['folds']}-fold cross-validation over prompts, "
          f"{res['repeats']} repeats of the N-sample subsample per N (mean ± std over repeats). Defaults stay "
          "plain least squares unless a variant wins below.", "", format_sigma_table(res), "",
          res["verdict"]["text"], ""]


def _regime(job: SumJob, dyn: dict[str, Any]) -> dict[str, Any]:
  """Whether every method reached its end state, per method, and what the preset promises."""
  per = {m: _state_label(dyn, m)[1] for m in job.cfg.methods}
  done = all(_state_label(dyn, m)[0] for m in job.cfg.methods)
  return {"preset": job.cfg.preset, "steps": job.cfg.train.total_steps, "all_at_end_state": done,
          "per_method": per}


def _grid_section(job, stage3: Stage3Runs, runs: dict, dyn: dict, s2: dict,
                  replicas: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
  """Per method, its end-state figures over seeds and regime; per regime, KL against sigma_g
  (`disa_jax.pipeline.grid`; a run on another Stage 1/2 data seed at its own anchor's sigma_g)."""
  figures = G.run_figures(G.collect(job, stage3, runs, dyn["matched_runs"]))
  others = {int(d): r["sigma_g_all"] for d, r in replicas.items() if d != "0" and "sigma_g_all" in r}
  return {"regimes": {m: G.regime_of(job, m) for m in figures}, "figures": figures,
          "sigma_curve": G.sigma_curve(job, figures, s2.get("sigma_g_all"), others)}


def _grid_md(report: dict) -> list[str]:
  """The regime table (`tables.regime_table`) and the KL-against-sigma_g rows."""
  md = ["## End-state figures per run (regime table)", "",
        "Mean ± std over the run's seeds [95% interval]; KL: the primary (decomposed) and the Monte "
        "Carlo one; steps to P(correct) = 0.9 (interpolated) over the seeds that got there; "
        "gradient noise = the mean squared gradient norm over the end-state window "
        f"(the last {report['instrument']['end_state']['window']:.0%} of steps; "
        "`disa_jax.pipeline.grid`).", "", *tables.regime_table(report), ""]
  if report["grid"]["sigma_curve"]:
    md += ["KL against the log Z error sigma_g (kl_vs_sigma.png), with the loss gap to the exact "
           "log Z run and Prop. 4's envelope sigma^2 + 2 sigma sqrt(L_TB):", "",
           *tables.sigma_table(report), ""]
  return md


def _cell(e: dict, key: str, fmt: str) -> str:
  if key + "_std" in e:
    return f"{e[key]:{fmt}} ± {e[key + '_std']:{fmt}}"
  return f"{e[key]:{fmt}}"


def _methods_md(job: SumJob, evals: dict[str, dict[str, Any]], regime: dict[str, Any],
                skipped: Mapping[str, str]) -> list[str]:
  """The end-state table: sampled metrics, the exact target and the KL decomposition."""
  k = next(iter(evals.values()))["k"] if evals else 8
  md = ["## Methods at the end of training", "",
        "Evaluation at temperature 1. KL(pi ‖ pi~), the primary KL every verdict uses: its exact "
        "decomposition KL(P_c ‖ P~_c) + P_c KL(pi|c ‖ pi~|c) + P_w KL(pi|w ‖ pi~|w) (only the last "
        "term is sampled); beside it the plain Monte Carlo KL with the exact log Z.", ""]
  if len(job.cfg.seeds) > 1:
    md += [f"Stage 3 seeds {list(job.cfg.seeds)}: cells are mean ± std over seeds (a single run's "
           "KL: ± its Monte Carlo standard error). A run with seeds of its own (`RunSpec.seeds`) "
           "says how many in its label.", ""]
  md += [f"| method | state | Mean@{k} | distinct correct in {k} | P(correct) | entropy over correct "
         "(target) | KL(pi ‖ pi~), decomposed | KL, Monte Carlo | KL binary | P_c KL_c | P_w KL_w |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
  kl = lambda e, key: (_cell(e, key, ".3f") if f"{key}_std" in e
                       else f"{e[key]:.3f} ± {e[key + '_se']:.3f}")
  for name, e in evals.items():
    label = f"{name} ({e['seeds']} seeds)" if "seeds" in e else name
    state = regime["per_method"].get(name.split("_seed")[0], "-")
    md.append(f"| {label} | {state} | {_cell(e, 'accuracy_mean_at_k', '.3f')} | "
              f"{_cell(e, 'distinct_correct_mean', '.2f')} | {_cell(e, 'p_correct_exact', '.3f')} | "
              f"{_cell(e, 'entropy_correct', '.2f')} ({e['target_entropy_correct']:.2f}) | "
              f"{kl(e, 'kl_decomposed')} | {kl(e, 'kl_to_target')} | "
              f"{_cell(e, 'kl_binary', '.3f')} | {_cell(e, 'p_correct_kl_correct', '.3f')} | "
              f"{_cell(e, 'p_wrong_kl_wrong', '.3f')} |")
  md += [f"| {name} | not trained: {why} | | | | | | | | | |" for name, why in skipped.items()]
  return md + [""]


def _matched_md(dyn: dict) -> list[str]:
  """Entropy over correct and KL over correct at each accuracy level, interpolated."""
  if not dyn["matched"]:
    return []
  md = ["## At matched accuracy (interpolated to P(correct) = level)", "",
        "Mean ± std over the seeds interpolated between the measurements around the level; a seed "
        "already past the level at its first measurement has no match there ('already past').", "",
        "| method | level | seeds matched | already past | step | entropy over correct | "
        "KL(pi\\|c ‖ pi~\\|c) | KL(pi ‖ pi~), decomposed |", "|---|---|---|---|---|---|---|---|"]
  for m, levels in dyn["matched"].items():
    for lvl, row in levels.items():
      got = f"{len(row['seeds_reached'])} of {row['seeds']} | {len(row['seeds_already_past'])}"
      if not row["seeds_reached"]:
        md.append(f"| {m} | {lvl} | {got} | - | - | - | - |")
        continue
      f = lambda key, fmt: f"{row[key][0]:{fmt}} ± {row[key][1]:{fmt}}"
      md.append(f"| {m} | {lvl} | {got} | {f('step', '.0f')} | {f('entropy_correct', '.2f')} | "
                f"{f('kl_correct', '.3f')} | {f('kl', '.3f')} |")
  return md + [""]


def _stage12_md(s1: dict, s2: dict, study: dict | None) -> list[str]:
  stats = (f"median ESS {s1['ess_median']:.2f}, median CV^2 {s1['cv2_median']:.3f}; proposal "
           f"accuracy {s1['proposal_accuracy']:.3f}; prompts with no correct sample: "
           f"{s1['prompts_without_correct_sample']}")
  fit = (f"- best epoch {s2['best_epoch']}, val MSE vs labels {s2['val_mse_vs_labels']:.4f}, val R^2 "
         f"vs labels {s2['val_r2_vs_labels']:.3f} ({s2['n_val']} held-out prompts)")
  if "n_study_mae_vs_exact" not in s1:  # labels on the mean scale: no exact value to compare with
    md = [f"## Stage 1 (labels on the {s1['label_scale']} scale: no exact value to compare with)", "",
          f"- N = {s1['n']}: {stats}", "", "| N | mean Var(log Z_N) |", "|---|---|"]
    md += [f"| {m} | {v:.4f} |" for m, v in s1["n_study_variance"].items()]
    return md + ["", "## Stage 2 (anchor)", "", fit, ""] + _anchor_study_md(study)
  md = ["## Stage 1 (log Z_IS against the exact log Z)", "",
        f"- N = {s1['n']}: mean |log Z_IS - log Z| = {s1['label_mae_vs_exact']:.4f}, mean signed error "
        f"{s1['label_signed_error_mean']:+.4f}; {stats}",
        f"- exact log Z across prompts: mean {s1['log_z_exact_mean']:.3f}, std {s1['log_z_exact_std']:.3f}",
        "", "| N | mean abs error vs exact | mean Var(log Z_N) |", "|---|---|---|"]
  md += [f"| {m} | {v:.4f} | {s1['n_study_variance'][m]:.4f} |" for m, v in s1["n_study_mae_vs_exact"].items()]
  md += ["", "## Stage 2 (anchor)", "", fit,
         f"- sigma_g = RMS(g(q) - log Z(q)): held-out {s2['sigma_g_heldout']:.4f}, all prompts "
         f"{s2['sigma_g_all']:.4f} (the raw labels' RMS error on the held-out prompts: "
         f"{s2['label_rmse_heldout']:.4f})", *_generalisation_md(s2.get("generalisation")), ""]
  return md + _anchor_study_md(study)


def _generalisation_md(gen: dict | None) -> list[str]:
  if gen is None:
    return []
  row = lambda name, g: (f"| {name} | {g['prompts']} | {g['log_z_std']:.3f} | {g['log_z_range']:.3f} "
                         f"| {g['r2']:.3f} | {g['sigma_g']:.4f} | {g['sigma_constant']:.4f} | "
                         f"{g['sigma_g_over_constant']:.3f} |")
  return ["", "The anchor on prompts it never saw (held out of Stages 2 and 3) against the exact "
          "log Z; the constant is the fit's mean label:", "",
          "| prompts | P | std log Z | range log Z | R^2 | sigma_g | sigma constant | "
          "sigma_g / constant |", "|---|---|---|---|---|---|---|---|",
          row("held out", gen["heldout"]), row("fitted", gen["fitted"])]


def _nstudy_md(ns: dict | None) -> list[str]:
  """The App. C.3 command's statistics (`workflows.nstudy`): variance and bias of log Z_M vs M."""
  if ns is None:
    return []
  md = ["## The App. C.3 N-study (stratified subset, pool of "
        f"{ns['pool_size']}; `nstudy/`)", "",
        f"- {ns['prompts']} prompts ({ns['prompts_with_full_pool']} with a full pool), "
        f"{ns['repeats']} subsamples per prompt and M", "",
        "| M | mean Var(log Z_M) | mean abs(Z_M - Z_pool) / Z_pool |", "|---|---|---|"]
  md += [f"| {r['M']} | {r['variance_mean']:.4f} | {r['relative_bias_mean']:.4f} |"
         for r in ns["per_m"]]
  if "variance_reduction_2_to_8" in ns:
    md += ["", f"- variance reduction from M = 2 to M = 8: {100 * ns['variance_reduction_2_to_8']:.1f}% "
           "(the paper: about 75%)"]
  if "relative_bias_change_8_to_16" in ns:
    md += [f"- relative bias removed from M = 8 to M = 16: "
           f"{100 * ns['relative_bias_change_8_to_16']:.1f} points (the paper: about 3)"]
  return md + [""]


def _anchor_gap_md(gap: dict | None) -> list[str]:
  if gap is None:
    return []
  check = (f"|L_DISA - L_TB| (training prompts) = {gap['loss_gap']:.4f} against the envelope with "
           f"the held-out sigma_g, {gap['envelope']:.4f}: " + (
               gap["verdict"] if gap["verdict"] is not None else f"no verdict ({gap['verdict_why']})"))
  return ["## The anchor's error: DISA against the oracle (Prop. 4)", "",
          f"- KL(pi ‖ pi~), decomposed: DISA (fitted anchor) {gap['kl_disa']:.3f}, disa_exact (exact log Z) "
          f"{gap['kl_disa_exact']:.3f}: gap {gap['kl_gap']:+.3f} nats",
          f"- at DISA's final policy, on the anchor's training prompts: sigma_g = "
          f"{gap['sigma_g_train']:.4f}, L_TB(exact log Z) = {gap['loss_tb']:.3f}, L_DISA = "
          f"{gap['loss_disa']:.3f}, |L_DISA - L_TB| = {gap['loss_gap']:.4f}; the same-sample "
          f"envelope sigma_g^2 + 2 sigma_g sqrt(L_TB) = {gap['envelope_same_sample']:.4f} "
          "(Cauchy-Schwarz on the same moments: it cannot be exceeded, so it is no evidence)",
          f"- held-out sigma_g = {gap['sigma_g_heldout']:.4f}; {check}", ""]


def instrument(job: SumJob) -> dict[str, Any]:
  """How this report decides (report.json's ``instrument``; `pipeline.tables` renders a report
  without it, from before issue 44, in the old format)."""
  e = job.cfg.end_state
  return {"primary_metric": D.PRIMARY, "beside": "kl_mc", "alpha": C.ALPHA, "correction": "holm",
          "end_state": dataclasses.asdict(e), "collapse_entropy_fraction": C.COLLAPSE_ENTROPY_FRACTION,
          "divergence_factor": C.DIVERGENCE_FACTOR,
          "seeds": "independent per run and Stage 3 seed (pipeline.seeds)"}


def _claims_md(report: dict) -> list[str]:
  regime, ins = report["regime"], report["instrument"]
  e = ins["end_state"]
  rule = (f"a method is at its end state when the {e['level']:.0%} interval of the change of the "
          f"primary KL and of the conditional KL over correct answers across the last "
          f"{e['window']:.0%} of measured steps (>= {e['min_points']} measurements, pooled over its "
          f"seeds) lies inside +-max({e['delta_abs']:g}, {e['delta_rel']:g} x the value)")
  head = ("Every method reached its end state" if regime["all_at_end_state"] else
          f"Preset {regime['preset']!r}: not every method reached its end state (verdicts marked "
          "TRANSIENT or 'end state undecided' compare runs not shown to be at it)")
  return ["## The paper's claims on this task", "",
          f"{head}; {rule}. Every verdict uses the primary KL `{ins['primary_metric']}` (the exact "
          "decomposition; the Monte Carlo KL is shown beside it). A run whose entropy over correct "
          f"answers is below {ins['collapse_entropy_fraction']:g} of the target's collapsed, one "
          f"whose KL is above {ins['divergence_factor']:g} x the reference policy's diverged: "
          "failures are counted by Fisher's "
          "exact test and KL compared by Welch's test over the other runs. A claim holds only if "
          f"its p-value, Holm-adjusted over the report's tests, is < {ins['alpha']:g}; a claim "
          "that could not be tested is undecided.", "", *tables.claims_table(report), "",
          "Numbers of each claim: `claims` in report.json.", ""]


@dataclasses.dataclass(frozen=True)
class Claim:
  """One verdict of the report (`pipeline.claims`; report.json's ``claims`` entries).

  Attributes:
    claim: what is claimed, in words.
    holds: whether the numbers support it (``verdict == 'holds'``).
    numbers: the numbers it is decided on (means, the test's statistics, ...).
    why: why it does not hold or is undecided (None: no reason to give).
    runs: the Stage 3 methods it compares (() for a claim about Stage 1).
    from_transient: some of ``runs`` were not shown to be at their end state.
    verdict: 'holds' | 'does not hold' | 'undecided' (a report from before issue 44: 'holds' /
      'does NOT hold', from ``holds``).
    state: 'end state' | 'transient' | 'undecided' | '-' (no runs); '' in an older report.
    test: {'name', 'p', 'p_holm', 'direction_ok', 'summary'} (None: untested, or an older report).
  """
  claim: str
  holds: bool
  numbers: Mapping[str, Any]
  why: str | None
  runs: tuple[str, ...]
  from_transient: bool
  verdict: str = ""
  state: str = ""
  test: Mapping[str, Any] | None = None

  @classmethod
  def from_json(cls, obj: Any, where: str) -> "Claim":
    if not isinstance(obj, dict):
      raise artifacts.ArtifactError(f"{where}: must be an object, got {type(obj).__name__}")
    holds = artifacts.field(obj, "holds", where, bool)
    optional = lambda name, kind, default: (artifacts.field(obj, name, where, kind) if name in obj
                                            else default)
    return cls(claim=artifacts.field(obj, "claim", where, str), holds=holds,
               numbers=artifacts.field(obj, "numbers", where, dict),
               why=artifacts.field(obj, "why", where, (str, type(None))),
               runs=artifacts.str_tuple(obj, "runs", where),
               from_transient=artifacts.field(obj, "from_transient", where, bool),
               verdict=optional("verdict", str, "holds" if holds else "does NOT hold"),
               state=optional("state", str, ""), test=optional("test", (dict, type(None)), None))


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
      figures only where the labels estimate it: `exact_on_label_scale`).
    stage2: the anchor's fit, and its sigma_g against the exact log Z (`exact_on_label_scale`).
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
  dir: Path
  methods: Mapping[str, Mapping[str, Any]]
  runs: Mapping[str, Mapping[str, Any]]
  claims: tuple[Claim, ...]
  skipped_methods: Mapping[str, str]
  regime: Mapping[str, Any]
  stage1: Mapping[str, Any]
  stage2: Mapping[str, Any]
  anchor_study: Mapping[str, Any] | None
  nstudy: Mapping[str, Any] | None
  anchor_gap: Mapping[str, Any] | None
  end_state: Mapping[str, list[Mapping[str, Any]]]
  matched_accuracy: Mapping[str, Mapping[str, Any]]
  conditional_kl: Mapping[str, Mapping[str, float]] | None
  grid: Mapping[str, Any] | None
  stage12_replicas: Mapping[str, Mapping[str, float]]
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
    path = Path(workdir) / cls.FILE
    obj = artifacts.read_json(path, "the main job's report")
    get = lambda name, kind=dict: artifacts.field(obj, name, path, kind)
    optional = lambda name: artifacts.field(obj, name, path, (dict, type(None)))
    seeds = get("stage3_seeds", list)
    if not all(isinstance(x, int) for x in seeds):
      raise artifacts.ArtifactError(f"{path}: field 'stage3_seeds' must be a list of ints")
    return cls(dir=Path(workdir), methods=get("methods"), runs=get("runs"),
               claims=tuple(Claim.from_json(c, f"{path} (claims[{i}])")
                            for i, c in enumerate(get("claims", list))),
               skipped_methods=get("skipped_methods"), regime=get("regime"),
               stage1=get("stage1"), stage2=get("stage2"), anchor_study=optional("anchor_study"),
               nstudy=optional("nstudy"), anchor_gap=optional("anchor_gap"),
               end_state=get("end_state"), matched_accuracy=get("matched_accuracy"),
               conditional_kl=optional("conditional_kl") if "conditional_kl" in obj else None,
               grid=optional("grid") if "grid" in obj else None,
               stage12_replicas=get("stage12_replicas") if "stage12_replicas" in obj else {},
               stage3_seeds=tuple(seeds), times_s=get("times_s"),
               plots=artifacts.str_tuple(obj, "plots", path))


@dataclasses.dataclass(frozen=True)
class ReportInputs:
  """The stages' artifacts the report reads (it opens no file of another stage's directory).

  Attributes:
    exact: the exact target of the job's prompts.
    pool: the Stage 1 samples (``[P, N]`` arrays; `Stage1Data`).
    anchor: Stage 2's output (the fitted anchor, its embedding cache and fit).
    stage3: every Stage 3 run, by (method, seed).
    evals: every evaluation row's `EvalResult` (its ``task`` benchmark is read).
    nstudy: the App. C.3 study (None when off).
    skipped: rows not trained, with the reason.
    conditional_kl: the rows' preference among correct answers (None when not computed:
      `MainConfig.conditional_kl` off).
    replicas: per further Stage 1/2 data seed d > 0 (`RunSpec.data_seed`), its pool and anchor.
  """
  exact: ExactTarget
  pool: Stage1Data
  anchor: AnchorArtifact
  stage3: Stage3Runs
  evals: Mapping[str, EvalResult]
  nstudy: NStudyResult | None = None
  skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)
  conditional_kl: ConditionalKLs | None = None
  replicas: Mapping[int, tuple[Stage1Data, AnchorArtifact]] = dataclasses.field(
      default_factory=dict)


def _conditional_kl_md(section: Mapping[str, Mapping[str, float]] | None) -> list[str]:
  """The table "Preference among correct answers": per row, the means of KL(pi|c ‖ pi~|c) and
  KL(pi|c ‖ p_T|c) over the training prompts (and over the held-out prompts, when there are any).

  Args:
    section: report.json's ``conditional_kl`` (`ConditionalKLs.report_section`); None: no table.
  """
  if section is None:
    return []
  held = any("kl_target_correct_mean_heldout" in e for e in section.values())
  cols = ["KL(pi\\|c ‖ pi~\\|c)", "KL(pi\\|c ‖ p_T\\|c)"]
  keys = ["kl_target_correct_mean", "kl_proposal_correct_mean"]
  if held:
    cols = [f"{c}, {where}" for where in ("training prompts", "held-out prompts") for c in cols]
    keys += [f"{k}_heldout" for k in keys]
  md = ["## Preference among correct answers", "",
        "Per model, the mean over prompts of KL(pi|c ‖ pi~|c) (against the target's preference "
        "among correct answers, pi~|c = pi_ref|c) and of KL(pi|c ‖ p_T|c) (against the proposal's); "
        "per prompt in conditional_kl.json.", "",
        "| model | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
  md += [f"| {row} | " + " | ".join(f"{e[k]:.4f}" if e.get(k) is not None else "-" for k in keys)
         + " |" for row, e in section.items()]
  return md + [""]


def _saved_anchor_study(job: SumJob) -> dict[str, Any] | None:
  """The job's anchor_study.json (`SumJob.anchor_study`), None when it did not run."""
  path = job.dir / "anchor_study.json"
  return json.loads(path.read_text()) if path.exists() else None


def _times_md(job: SumJob) -> list[str]:
  return ["## Time per stage (s)", "", ", ".join(f"{k} {v:.1f}" for k, v in job.times.items())]


def write_report(job: SumJob, inputs: ReportInputs) -> JobReport:
  """report.json / report.md / PNGs in the job's directory (``job``: the `SumJob`, its configs).

  Returns:
    The report, as loaded back from report.json (`JobReport`).
  """
  skipped, exact, stage3, results = dict(inputs.skipped), inputs.exact, inputs.stage3, inputs.evals
  runs = {name: eval_row(r.benchmarks[TASK]) for name, r in results.items()}
  evals = aggregate_seeds(job, runs)
  s1 = _stage1_section(job, inputs.pool, exact)
  s2 = _stage2_section(job, inputs.anchor, inputs.pool, exact)
  dyn = _dynamics(job, stage3)
  regime = _regime(job, dyn)
  fix = job.cfg.fix if job.cfg.fix in evals else None
  contrasts = [m for m in job.cfg.methods if job.cfg.runs[m].objective.maximises_reward]
  claims = _claims(job, s1, runs, dyn, fix, contrasts)
  gap = _anchor_gap(evals, results, inputs.anchor, exact)
  plots = _plots(job, s1, s2, _training_curves(job, stage3))
  replicas = _replicas_section(job, inputs, s1, s2)
  grid = _grid_section(job, stage3, runs, dyn, s2, replicas)
  plots += G.plot_sigma_curve(grid["sigma_curve"], job.dir)
  if dyn["series"]:
    plots += D.plot_dynamics(dyn["series"], float(np.mean(exact.target_entropy_correct)), job.dir)
  study = _saved_anchor_study(job)
  nstudy = None if inputs.nstudy is None else inputs.nstudy.study_json()
  pairs = job.cfg.endpoints.pairs(job.cfg.methods)
  ends = (EP.section(EP.collect(stage3, {m: job.cfg.run_seeds(m) for m in job.cfg.methods}), pairs)
          if pairs else None)
  report = {"instrument": instrument(job), "config": {"beta": job.cfg.beta, "task": f"n in [{job.task.n_min}, {job.task.n_max}]",
                       "engine": job.cfg.engine.kind, "stage3_steps": job.cfg.train.total_steps,
                       "preset": job.cfg.preset},
            "regime": regime, "stage1": s1, "stage2": {k: v for k, v in s2.items() if k != "val_mse_curve"},
            "anchor_study": study, "nstudy": nstudy, "anchor_gap": gap, "methods": evals, "runs": runs,
            **({} if inputs.conditional_kl is None else
               {"conditional_kl": inputs.conditional_kl.report_section()}),
            "end_state": dyn["end_state"], "end_state_methods": dyn["method_state"],
            "matched_accuracy": dyn["matched"], "grid": grid,
            "matched_accuracy_runs": {m: dict(v) for m, v in dyn["matched_runs"].items()},
            "stage3_seeds": list(job.cfg.seeds),
            "run_seeds": {m: list(job.cfg.run_seeds(m)) for m in job.cfg.methods},
            "stage12_replicas": replicas, **({} if ends is None else {"endpoints": ends}),
            "skipped_methods": skipped, "claims": claims,
            "times_s": job.times, "plots": plots}
  (job.dir / "report.json").write_text(json.dumps(report, indent=1, default=float))
  md = [f"# DISA main job: sum task, n in [{job.task.n_min}, {job.task.n_max}], beta = {job.cfg.beta}", "",
        f"Preset {job.cfg.preset!r}, {job.cfg.train.total_steps} Stage 3 steps per run. Engine: "
        f"{job.cfg.engine.kind}. Models: tiny Qwen3 ({job.arch.num_layers} layers, d = "
        f"{job.arch.hidden_size}), trained here and reloaded from HF checkpoints.", "",
        *_methods_md(job, evals, regime, skipped), *_grid_md(report),
        *_conditional_kl_md(report.get("conditional_kl")), *_matched_md(dyn),
        *([] if ends is None else EP.markdown(ends)), *_claims_md(report),
        *_anchor_gap_md(gap), *_stage12_md(s1, s2, study), *_replicas_md(report["stage12_replicas"]),
        *_nstudy_md(nstudy),
        *_times_md(job), "",
        "Plots: " + ", ".join(plots)]
  (job.dir / "report.md").write_text("\n".join(md) + "\n")
  return JobReport.load(job.dir)


@dataclasses.dataclass(frozen=True)
class AnchorReport:
  """Stages 1-2 of the job alone (`MainConfig.stages` = 'anchor'): ``anchor_report.json`` (the
  report's ``stage1`` / ``stage2`` sections, with ``generalisation`` where prompts are held out of
  the fit) and ``anchor_report.md``."""
  dir: Path
  stage1: dict[str, Any]
  stage2: dict[str, Any]

  def markdown(self) -> str:
    return (self.dir / "anchor_report.md").read_text()


def write_anchor_report(job: SumJob, pool: Stage1Data, anchor: AnchorArtifact,
                        exact: ExactTarget) -> AnchorReport:
  """``anchor_report.json`` / ``.md`` in the job's directory: the Stage 1 and Stage 2 sections of
  `write_report`, computed the same way, and the times so far."""
  s1 = _stage1_section(job, pool, exact)
  s2 = {k: v for k, v in _stage2_section(job, anchor, pool, exact).items() if k != "val_mse_curve"}
  study = _saved_anchor_study(job)
  out = {"config": {"beta": job.cfg.beta, "task": f"n in [{job.task.n_min}, {job.task.n_max}]",
                    "preset": job.cfg.preset, "heldout": dataclasses.asdict(job.cfg.heldout)},
         "stage1": s1, "stage2": s2, "times_s": job.times}
  (job.dir / "anchor_report.json").write_text(json.dumps(out, indent=1, default=float))
  md = [f"# DISA main job, Stages 1-2: sum task, n in [{job.task.n_min}, {job.task.n_max}], "
        f"beta = {job.cfg.beta}", "", f"Preset {job.cfg.preset!r} (stages = 'anchor').", "",
        *_stage12_md(s1, s2, study),
        *_times_md(job)]
  (job.dir / "anchor_report.md").write_text("\n".join(md) + "\n")
  return AnchorReport(job.dir, s1, s2)
