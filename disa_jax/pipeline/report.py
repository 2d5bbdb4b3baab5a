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

from disa_jax import codec
from disa_jax import estimators as E
from disa_jax.anchor.diagnostics import generalisation, prop4_check, sigma_g
from disa_jax.anchor.labels import anchor_targets
from disa_jax.data import loaders
from disa_jax.estimators.dataset import Stage1Data
from disa_jax.eval.exact import ExactTarget
from disa_jax.pipeline import dynamics as D
from disa_jax.pipeline import endpoints as EP
from disa_jax.pipeline import grid as G
from disa_jax.pipeline.job_report import JobReport
from disa_jax.pipeline import claims as C
from disa_jax.pipeline import report_md as MD
from disa_jax.pipeline import seeds
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
      out["end_state"][m] = [codec.encode(e) | {"seed": seed} for seed, e in ends]
      out["method_state"][m] = codec.encode(D.method_end_state([e for _, e in ends], cfg))
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
  plan = C.Plan(fix=fix or "", contrasts=tuple(contrasts), controls=tuple(job.cfg.controls),
                compare=tuple(job.cfg.compare), replay=replay_pairs(job.cfg.runs, job.cfg.methods))
  return C.build_claims(ev, plan, s1.get("n_disjoint_abs_error") if exact_on_label_scale(job) else None)


def replay_pairs(runs: Mapping[str, Any], methods: Sequence[str]) -> tuple[tuple[str, str], ...]:
  """Issue 9's replay comparisons, from the runs' specs: (m, b) for each run m that replaces a
  share of its groups' slots by Stage 1 samples (replay mode 'replace') and each run b of
  ``methods`` that is m without replay (the same `RunSpec` but for its replay section)."""
  out = []
  for m in methods:
    spec = runs[m]
    if spec.replay.enabled and spec.replay.mode == "replace":
      out += [(m, b) for b in methods
              if b != m and not runs[b].replay.enabled
              and dataclasses.replace(runs[b], replay=spec.replay) == spec]
  return tuple(out)


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


def instrument(job: SumJob) -> dict[str, Any]:
  """How this report decides (report.json's ``instrument``; `pipeline.tables` renders a report
  without it, from before issue 44, in the old format)."""
  e = job.cfg.end_state
  return {"primary_metric": D.PRIMARY, "beside": "kl_mc", "alpha": C.ALPHA, "correction": "holm",
          "end_state": dataclasses.asdict(e), "collapse_entropy_fraction": C.COLLAPSE_ENTROPY_FRACTION,
          "divergence_factor": C.DIVERGENCE_FACTOR,
          "seeds": "independent per run and Stage 3 seed (pipeline.seeds)"}


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


def _saved_anchor_study(job: SumJob) -> dict[str, Any] | None:
  """The job's anchor_study.json (`SumJob.anchor_study`), None when it did not run."""
  path = job.dir / "anchor_study.json"
  return json.loads(path.read_text()) if path.exists() else None


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
        *MD.methods_md(job, evals, regime, skipped), *MD.grid_md(report),
        *MD.conditional_kl_md(report.get("conditional_kl")), *MD.matched_md(dyn),
        *([] if ends is None else EP.markdown(ends)), *MD.claims_md(report),
        *MD.anchor_gap_md(gap), *MD.stage12_md(s1, s2, study), *MD.replicas_md(report["stage12_replicas"]),
        *MD.nstudy_md(nstudy),
        *MD.times_md(job), "",
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
        *MD.stage12_md(s1, s2, study),
        *MD.times_md(job)]
  (job.dir / "anchor_report.md").write_text("\n".join(md) + "\n")
  return AnchorReport(job.dir, s1, s2)
