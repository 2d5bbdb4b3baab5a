"""The offline job: Stage 1 (IS labels) and Stage 2 (frozen anchor) on the tabular synthetic problem.

`run(OfflineConfig, workdir)` draws N proposal samples per prompt of a `make_tabular_problem` problem
(whose exact log Z is known), labels every prompt with log Z_IS (eq. 8), fits the anchor g_psi on the
prompt embeddings (eq. 9), and compares both, and the App. D.3 N-study, with the exact log Z. It writes
to the workdir:

    stage1.jsonl | stage1/   the Stage 1 dataset, appended in chunks (resumable)
    anchor/                  the frozen `Anchor` (orbax + metadata, with its fit summary)
    report.json, report.md   label and anchor errors against the exact log Z, timings

A second run with the same workdir skips finished Stage 1 prompts and reloads the anchor.
`launch/offline.py` is its command line (`configs/offline_synthetic.py` documents every field).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from tqdm import tqdm

from disa_jax import codec
from disa_jax import config as config_lib
from disa_jax import estimators as E
from disa_jax.anchor import Anchor, AnchorFitConfig, fit_anchor
from disa_jax.estimators.synthetic import TabularProblem, make_tabular_problem
from disa_jax.pipeline import seeds

FORMATS = ("jsonl", "parquet")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularProblemConfig:
  """The ``problem`` section: the arguments of `make_tabular_problem` (P, K, D, ...)."""

  prompts: int
  outputs: int
  dim: int
  n_correct: int
  beta: float
  proposal_beta: float
  proposal_mix: float

  def __post_init__(self):
    if not self.beta > 0:
      raise ValueError(f"problem.beta must be > 0, got {self.beta!r}")
    if not self.prompts >= 10:
      raise ValueError(f"problem.prompts must be >= 10, got {self.prompts!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineStage1Config:
  """The ``stage1`` section: proposal samples, labels, durable chunks and the N-study."""

  samples: int
  reward_transform: E.RewardTransform
  chunk: int
  format: str
  n_study: tuple[int, ...]
  n_study_repeats: int

  def __post_init__(self):
    if not self.samples >= 1:
      raise ValueError(f"stage1.samples must be >= 1, got {self.samples!r}")
    if not self.chunk >= 1:
      raise ValueError(f"stage1.chunk must be >= 1, got {self.chunk!r}")
    if self.format not in FORMATS:
      raise ValueError(f"stage1.format must be one of {FORMATS}, got {self.format!r}")
    if not all(1 <= m for m in self.n_study):
      raise ValueError(f"stage1.n_study values must be >= 1, got {self.n_study!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineStage2Config:
  """The ``stage2`` section: the anchor regressor's hyper-parameters (seeded by the top-level seed)."""

  hidden_sizes: tuple[int, ...]
  learning_rate: float
  batch_size: int
  epochs: int
  val_fraction: float

  def __post_init__(self):
    self.fit_config(seed=0)  # AnchorFitConfig validates the values, naming the field

  def fit_config(self, seed: int) -> AnchorFitConfig:
    """The `AnchorFitConfig` of these settings, seeded with ``seed``."""
    return AnchorFitConfig(hidden_sizes=self.hidden_sizes, learning_rate=self.learning_rate,
                           batch_size=self.batch_size, epochs=self.epochs,
                           val_fraction=self.val_fraction, seed=seed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineConfig(config_lib.Section):
  """Typed, validated view of `configs/offline_synthetic.py` (the fields are documented there)."""

  seed: int
  problem: TabularProblemConfig
  stage1: OfflineStage1Config
  stage2: OfflineStage2Config


  @property
  def fit(self) -> AnchorFitConfig:
    """Stage 2's `AnchorFitConfig`, seeded with ``seed``."""
    return self.stage2.fit_config(self.seed)


def _chunk_records(problem: TabularProblem, start: int, ids: list[str], key: jax.Array,
                   cfg: OfflineStage1Config) -> list[dict[str, Any]]:
  """Samples and labels one chunk of prompts.

  Args:
    problem: the tabular problem.
    start: index of the chunk's first prompt.
    ids: the chunk's prompt ids (C of them, prompts ``start .. start + C - 1``).
    key: the Stage 1 key; the chunk's samples use ``fold_in(key, start)``, so a resumed run draws the
      same samples.
    cfg: the Stage 1 settings.

  Returns:
    C Stage 1 records (`E.build_records`, sum label scale), N = ``cfg.samples`` samples each.
  """
  end = start + len(ids)
  sub = dataclasses.replace(problem, embeddings=problem.embeddings[start:end],
                            logp_ref=problem.logp_ref[start:end],
                            logp_proposal=problem.logp_proposal[start:end],
                            reward=problem.reward[start:end])
  s = sub.sample(jax.random.fold_in(key, start), cfg.samples)  # [C, N] arrays; seeded by chunk
  samples = [[{"token_ids": [int(s["output"][i, j])], "text": f"o{int(s['output'][i, j])}",
               "logp_ref": float(s["logp_ref"][i, j]), "logp_proposal": float(s["logp_proposal"][i, j]),
               "reward": float(s["reward"][i, j]), "num_tokens": 1} for j in range(cfg.samples)]
             for i in range(len(ids))]
  return E.build_records(ids, [f"synthetic prompt {i}" for i in ids], samples, beta=problem.beta,
                         reward_transform=cfg.reward_transform, label_scale="sum")


def _stage1(problem: TabularProblem, cfg: OfflineConfig, workdir: Path) -> E.Stage1Data:
  """Stage 1: N proposal samples per prompt -> log Z_IS labels, appended chunk by chunk (resumable).

  Args:
    problem: the tabular problem (P prompts).
    cfg: the job's config.
    workdir: the output directory.

  Returns:
    The Stage 1 dataset as written (P prompts, in the order they were written).
  """
  fmt = cfg.stage1.format
  path = workdir / ("stage1.jsonl" if fmt == "jsonl" else "stage1")
  key = jax.random.key(cfg.seed)
  p = problem.log_z.shape[0]
  chunk = cfg.stage1.chunk
  with E.Stage1Writer(path, fmt=fmt) as writer:
    done = writer.completed_ids()
    for start in tqdm(range(0, p, chunk), desc="stage 1", unit="chunk"):
      ids = [f"q{i:06d}" for i in range(start, min(p, start + chunk))]
      if all(i in done for i in ids):
        continue
      recs = _chunk_records(problem, start, ids, key, cfg.stage1)
      writer.write([r for r in recs if r["prompt_id"] not in done])
  return E.load_stage1(path, fmt=fmt)


def _stage2(emb: np.ndarray, labels: np.ndarray, beta: float, cfg: OfflineConfig,
            anchor_dir: Path) -> tuple[Anchor, np.ndarray]:
  """Stage 2: fits the anchor on the prompt embeddings, or reloads it from ``anchor_dir``.

  Args:
    emb: ``[P, D]`` prompt embeddings, in the order of ``labels``.
    labels: ``[P]`` log Z_IS labels.
    beta: the target's inverse temperature.
    cfg: the job's config.
    anchor_dir: where the anchor is saved (with its fit summary and validation indices).

  Returns:
    (the frozen anchor, ``[V]`` indices of its held-out validation prompts; empty without a split).
  """
  if (anchor_dir / "anchor_meta.json").exists():
    anchor = Anchor.load(anchor_dir)
    return anchor, np.asarray(anchor.meta.fit_summary.get("val_idx", []), np.int64)
  res = fit_anchor(emb, labels, beta=beta, reward_transform=cfg.stage1.reward_transform, label_scale="sum",
                   config=cfg.fit)
  anchor = res.anchor
  anchor.meta = dataclasses.replace(anchor.meta, fit_summary=dict(res.summary(), val_idx=res.val_idx.tolist(),
                                                                  history=res.history))
  anchor.save(anchor_dir)
  return anchor, res.val_idx


def _n_study_errors(problem: TabularProblem, cfg: OfflineConfig) -> dict[str, float]:
  """The App. D.3 N-study on a fresh pool of proposal samples, against the exact log Z.

  Args:
    problem: the tabular problem.
    cfg: the job's config (``stage1.n_study`` sample counts M, repeats, seed).

  Returns:
    M (as a string) -> mean absolute error of log Z_IS from M samples, over prompts and repeats.
  """
  pool = problem.sample(jax.random.key(seeds.job_seed(cfg.seed, "offline_pool")),
                        max(cfg.stage1.n_study))  # [P, max M] arrays
  pool_lw = E.log_importance_weights(pool["logp_ref"], pool["logp_proposal"],
                                     cfg.stage1.reward_transform.apply(pool["reward"]), problem.beta)
  study = E.n_study(jax.random.key(seeds.job_seed(cfg.seed, "offline_n_study")), pool_lw,
                    ms=cfg.stage1.n_study,
                    repeats=cfg.stage1.n_study_repeats, log_z_ref=problem.log_z)
  return {str(m): float(np.nanmean(study.log_abs_error[i])) for i, m in enumerate(study.ms)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineStage1:
  """The offline report's Stage 1 labels against the exact log Z (nats): their mean absolute and
  signed error, the weights' median ESS and CV^2, and per N the mean |log Z_N - log Z|."""
  label_mae_vs_exact: float
  label_bias_vs_exact: float
  ess_median: float
  cv2_median: float
  n_study_mae_vs_exact: Mapping[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineStage2:
  """The offline report's frozen anchor: its fit against its labels (best epoch, validation MSE
  and R^2; None where the fit had no validation split) and, on the held-out prompts, its sigma_g
  and the raw labels' RMS error against the exact log Z (nats)."""
  best_epoch: int | None
  val_mse_vs_labels: float | None
  val_r2_vs_labels: float | None
  sigma_g_heldout_vs_exact: float
  label_rmse_heldout_vs_exact: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class OfflineReport:
  """The offline job's report.json (`run`): the problem's size, the samples per prompt, beta, the
  two stages' figures and the seconds per stage (``stage1_s``, ``stage2_s``)."""
  prompts: int
  samples_per_prompt: int
  beta: float
  stage1: OfflineStage1
  stage2: OfflineStage2
  times_s: Mapping[str, float]


def _report(problem: TabularProblem, cfg: OfflineConfig, data: E.Stage1Data, order: np.ndarray,
            anchor: Anchor, val_idx: np.ndarray, times: dict[str, float]) -> OfflineReport:
  """The report: Stage 1 labels and the Stage 2 anchor against the exact log Z.

  Args:
    problem: the tabular problem (P prompts).
    cfg: the job's config.
    data: the Stage 1 dataset.
    order: ``[P]`` problem row of each Stage 1 record.
    anchor: the frozen anchor.
    val_idx: the anchor's held-out prompts (indices into ``data``); empty = all prompts.
    times: seconds per stage.

  Returns:
    The report (``report.json``).
  """
  p = problem.log_z.shape[0]
  labels = data.labels
  pred = np.asarray(anchor(problem.embeddings[order]))
  truth = problem.log_z[order]
  held = val_idx if val_idx.size else np.arange(p)
  fs = anchor.meta.fit_summary
  return OfflineReport(
      prompts=p, samples_per_prompt=cfg.stage1.samples, beta=problem.beta,
      stage1=OfflineStage1(
          label_mae_vs_exact=float(np.mean(np.abs(labels - truth))),
          label_bias_vs_exact=float(np.mean(labels - truth)),
          ess_median=float(np.nanmedian(data.stats.ess)),
          cv2_median=float(np.nanmedian(data.stats.cv2)),
          n_study_mae_vs_exact=_n_study_errors(problem, cfg)),
      stage2=OfflineStage2(
          best_epoch=fs.get("best_epoch"), val_mse_vs_labels=fs.get("val_mse"),
          val_r2_vs_labels=fs.get("val_r2"),
          sigma_g_heldout_vs_exact=float(np.sqrt(np.mean((pred[held] - truth[held]) ** 2))),
          label_rmse_heldout_vs_exact=float(np.sqrt(np.mean((labels[held] - truth[held]) ** 2)))),
      times_s=times)


def _report_markdown(report: OfflineReport) -> str:
  """``report.md``: the report in words and tables."""
  s1, s2, times = report.stage1, report.stage2, report.times_s
  md = [f"# DISA offline stages on the tabular synthetic problem ({report.prompts} prompts, "
        f"N = {report.samples_per_prompt}, beta = {report.beta})",
        "", "## Stage 1: log Z_IS against the exact log Z", "",
        f"- mean |log Z_IS - log Z| = {s1.label_mae_vs_exact:.4f}; "
        f"mean signed error = {s1.label_bias_vs_exact:+.4f}",
        f"- median ESS = {s1.ess_median:.2f}, median CV^2 = {s1.cv2_median:.3f}", "",
        "| N | mean abs error vs exact |", "|---|---|"]
  md += [f"| {m} | {v:.4f} |" for m, v in s1.n_study_mae_vs_exact.items()]
  md += ["", "## Stage 2: the frozen anchor", "",
         f"- best epoch {s2.best_epoch}, val MSE vs labels {s2.val_mse_vs_labels:.4f}, "
         f"val R^2 {s2.val_r2_vs_labels:.3f}",
         f"- sigma_g = RMS(g(q) - log Z(q)) on held-out prompts: {s2.sigma_g_heldout_vs_exact:.4f} "
         f"(the raw labels' RMS error there: {s2.label_rmse_heldout_vs_exact:.4f})", "",
         f"Times: stage 1 {times['stage1_s']:.1f} s, stage 2 {times['stage2_s']:.1f} s."]
  return "\n".join(md) + "\n"


def run(cfg: OfflineConfig, workdir: Path) -> OfflineReport:
  """Runs (or resumes) Stage 1 and Stage 2 on the tabular problem and writes the reports.

  Args:
    cfg: the job's config.
    workdir: the output directory (created; reused to resume).

  Returns:
    The report (also in ``report.json``; ``report.md`` says it in words).
  """
  workdir.mkdir(parents=True, exist_ok=True)
  problem = make_tabular_problem(cfg.seed, **dataclasses.asdict(cfg.problem))
  t0 = time.time()
  data = _stage1(problem, cfg, workdir)
  order = np.asarray([int(i[1:]) for i in data.prompt_ids])  # [P] problem row of each record
  times = {"stage1_s": time.time() - t0}
  t0 = time.time()
  anchor, val_idx = _stage2(problem.embeddings[order], data.labels, problem.beta, cfg, workdir / "anchor")
  times["stage2_s"] = time.time() - t0
  report = _report(problem, cfg, data, order, anchor, val_idx, times)
  (workdir / "report.json").write_text(json.dumps(codec.encode(report), indent=1))
  (workdir / "report.md").write_text(_report_markdown(report))
  return report
