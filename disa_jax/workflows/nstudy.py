"""The paper's offline-budget study (App. C.3) on real checkpoints: how log Z_M behaves as M grows.

`run_nstudy(NStudyConfig)`:

1. **Subset.** Embeds every training prompt with pi_ref (mean-pooled final states, as Stage 2 does),
   runs k-means for each candidate k, picks k at the elbow of the SSE curve
   (`estimators.nstudy.elbow_k`) and draws a subset of ``subset_size`` prompts stratified by cluster
   (`estimators.nstudy.stratified_subset`). The subset is written as a veRL prompt file.
2. **Pool.** Runs Stage 1 (`run_stage1`, resumable) on the subset with N = ``pool_size`` proposal
   samples per prompt (paper: 32).
3. **Study.** For each M in ``ms`` draws ``repeats`` subsamples of M of the pool per prompt and
   reports the variance of log Z_M and the relative bias |Z_M - Z_pool| / Z_pool
   (`estimators.nstudy.n_study`), with the paper's two headline figures: the variance reduction
   from M = 2 to M = 8 and the change in relative bias from M = 8 to M = 16.

Output directory:
    subset.jsonl, subset.json     the stratified subset (veRL rows) and how it was chosen (k, SSE)
    stage1/                       the Stage 1 run on the subset (its own resumable output directory)
    nstudy.json, nstudy.png       the per-M statistics and the figure (variance, relative bias vs M)
    nstudy_config.json            the resolved config
    nstudy_identity.json          what the subset and the pool depend on (the prompt file's and
                                  pi_ref's content hashes, sampling, labels, sizes, seed): a rerun
                                  must agree on it, or it stops naming the fields (overwrite=True
                                  discards the study instead)

A rerun resumes: the subset is reused, Stage 1 skips finished prompts, the statistics are
recomputed from the pool (seconds).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax.anchor.embeddings import embed_prompts
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.rows import save_prompts
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.estimators import nstudy as nstudy_lib
from disa_jax.estimators.dataset import load_stage1
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows.preflight import PreflightError, preflight
from disa_jax.checkpoint import identity
from disa_jax.workflows.stage1 import IDENTITY_FIELDS as STAGE1_IDENTITY_FIELDS
from disa_jax.workflows.stage1 import (ScorerConfig, Stage1Config, Stage1Result, load_reference,
                                       run_stage1)

# What the subset and the pool depend on: a rerun into the same directory must agree on them.
STUDY_FIELDS = ("subset_size", "pool_size", "ks", "kmeans_iters", "seed")
STAGE1_FIELDS = STAGE1_IDENTITY_FIELDS + ("limit",)
OUTPUTS = ("subset.json", "subset.jsonl", "stage1", "nstudy.json", "nstudy.png")  # overwrite=True


@dataclasses.dataclass(frozen=True, kw_only=True)
class NStudyConfig(config_lib.Section):
  """Typed view of `configs/nstudy_paper.py` (the fields are documented there).

  ``stage1`` is the Stage 1 config of the whole prompt set (its ``prompts_path`` is the corpus the
  subset is drawn from); the workflow runs it on the subset, with ``pool_size`` samples per prompt,
  in ``<output_dir>/stage1``.
  """

  stage1: Stage1Config
  output_dir: str
  subset_size: int = 500
  pool_size: int = 32
  ms: tuple[int, ...] = (2, 4, 8, 16)
  repeats: int = 200
  ks: tuple[int, ...] = tuple(range(2, 21))
  kmeans_iters: int = 50
  seed: int = 0
  embedding: ScorerConfig = ScorerConfig()
  overwrite: bool = False

  def __post_init__(self):
    if not self.output_dir:
      raise ValueError("output_dir is required (a local path), got ''")
    if self.subset_size < 1:
      raise ValueError(f"subset_size must be >= 1, got {self.subset_size}")
    if self.repeats < 2:
      raise ValueError(f"repeats must be >= 2 (a variance needs two draws), got {self.repeats}")
    if not self.ms or any(not 1 <= m <= self.pool_size for m in self.ms):
      raise ValueError(f"ms must be non-empty with every M in [1, pool_size={self.pool_size}], "
                       f"got {self.ms}")
    if len(self.ks) < 3 or any(k < 1 for k in self.ks) or list(self.ks) != sorted(set(self.ks)):
      raise ValueError(f"ks must be >= 3 increasing values >= 1 (the elbow needs a curve), got "
                       f"{self.ks}")


  def pool_config(self) -> Stage1Config:
    """The Stage 1 run of the subset: ``pool_size`` samples per prompt, in ``<output_dir>/stage1``."""
    out = Path(self.output_dir)
    return dataclasses.replace(
        self.stage1, prompts_path=str(out / "subset.jsonl"), prompts_format="verl", limit=0,
        output_dir=str(out / "stage1"),
        sampling=dataclasses.replace(self.stage1.sampling, n=self.pool_size))




def preflight_nstudy(cfg: NStudyConfig) -> list[str]:
  """`launch/nstudy.py`'s checks before any weights load: those of the pool's Stage 1 config
  (`disa_jax.workflows.preflight`), each problem named by its field under ``stage1``."""
  try:
    return preflight(cfg.stage1)
  except PreflightError as e:
    raise PreflightError(" | ".join(f"stage1.{p}" for p in str(e).split(" | "))) from None


def claim_nstudy_output(cfg: NStudyConfig) -> str:
  """Records (or checks) what the subset and the pool depend on in ``nstudy_identity.json``: the
  prompt file's and pi_ref's content, the Stage 1 fields behind the labels, the study's sizes and
  seed; returns `disa_jax.checkpoint.identity.claim_output`'s state.

  Raises:
    IdentityMismatchError: the directory holds a study of other inputs and ``overwrite`` is off.
  """
  out = Path(cfg.output_dir)
  s1 = config_lib.to_dict(cfg.stage1)
  ident = {**identity.inputs(prompts_path=cfg.stage1.prompts_path,
                             reference_path=cfg.stage1.reference_path),
           **{f"stage1.{f}": s1[f] for f in STAGE1_FIELDS},
           **{f: config_lib.to_dict(getattr(cfg, f)) for f in STUDY_FIELDS},
           "embedding.dtype": cfg.embedding.dtype}

  return identity.claim_output(out / "nstudy_identity.json", ident, overwrite=cfg.overwrite,
                               has_output=(out / "subset.json").exists(),
                               discard=lambda: identity.remove_paths(out / n for n in OUTPUTS))


def choose_subset(cfg: NStudyConfig) -> dict[str, Any]:
  """Embeds the prompts, picks k at the SSE elbow, writes the stratified subset (or reuses it).

  Returns:
    The subset's description (also ``subset.json``): k, the SSE curve, cluster sizes, prompt ids.
  """
  out = Path(cfg.output_dir)
  info_path, subset_path = out / "subset.json", out / "subset.jsonl"
  if info_path.exists() and subset_path.exists():  # written last: the subset is complete
    return json.loads(info_path.read_text())
  s1 = cfg.stage1
  records = load_prompts(s1.prompts_path, s1.prompts_format, limit=s1.limit or None)
  if len(records) < max(cfg.ks):
    raise ValueError(f"stage1.prompts_path={s1.prompts_path!r} has {len(records)} prompts, fewer "
                     f"than the largest k in ks={cfg.ks}")
  tok = load_tokenizer(s1.reference_path)
  ids = [encode_prompt(tok, r, s1.rendering, max_len=s1.max_prompt_len) for r in records]
  model = load_reference(s1.reference_path, cfg.embedding)
  emb, _ = embed_prompts(model, ids, pad_id=int(tok.pad_token_id),
                         batch_size=cfg.embedding.batch_size, pad_to=cfg.embedding.pad_to,
                         row_len=cfg.embedding.row_len, packing=cfg.embedding.packing)
  key = jax.random.key(cfg.seed)
  sse = nstudy_lib.sse_curve(jax.random.fold_in(key, 0), emb, cfg.ks, iters=cfg.kmeans_iters)
  k = nstudy_lib.elbow_k(cfg.ks, sse)
  _, labels, _ = nstudy_lib.kmeans(jax.random.fold_in(key, 1), emb, k=k, iters=cfg.kmeans_iters)
  chosen = nstudy_lib.stratified_subset(jax.random.fold_in(key, 2), labels, cfg.subset_size)
  save_prompts([records[i] for i in chosen], str(subset_path))
  labels = np.asarray(labels)
  info = {"prompts": len(records), "k": int(k), "ks": list(cfg.ks), "sse": [float(s) for s in sse],
          "cluster_sizes": np.bincount(labels, minlength=k).tolist(),
          "subset_cluster_sizes": np.bincount(labels[chosen], minlength=k).tolist(),
          "prompt_ids": [records[i].prompt_id for i in chosen]}
  artifacts.write_json(info_path, info)
  return info


def study_pool(cfg: NStudyConfig) -> dict[str, Any]:
  """The App. C.3 statistics of the Stage 1 pool (``nstudy.json``) and its figure (``nstudy.png``)."""
  pool = cfg.pool_config()
  data = load_stage1(pool.dataset_path(), pool.dataset_format)
  full = data.mask.sum(1) >= cfg.pool_size
  res = nstudy_lib.n_study(jax.random.key(cfg.seed + 1), data.log_weights(), data.mask,
                           ms=cfg.ms, repeats=cfg.repeats)
  rows = res.summary()
  by_m = {r["M"]: r for r in rows}
  out = {"prompts": len(data.prompt_ids), "prompts_with_full_pool": int(full.sum()),
         "pool_size": cfg.pool_size, "repeats": cfg.repeats, "per_m": rows}
  if 2 in by_m and 8 in by_m:  # the paper: variance falls ~75% from M = 2 to M = 8
    out["variance_reduction_2_to_8"] = 1.0 - by_m[8]["variance_mean"] / by_m[2]["variance_mean"]
  if 8 in by_m and 16 in by_m:  # the paper: M = 8 -> 16 removes ~3 points of relative bias
    out["relative_bias_change_8_to_16"] = (by_m[8]["relative_bias_mean"]
                                           - by_m[16]["relative_bias_mean"])
  artifacts.write_json(Path(cfg.output_dir) / "nstudy.json", out)
  plot_nstudy(rows, Path(cfg.output_dir) / "nstudy.png")
  return out


def plot_nstudy(rows: list[dict[str, float]], path: Path) -> None:
  """Variance of log Z_M and relative bias against M (log2 axis), as in App. C.3."""
  import matplotlib  # pylint: disable=g-import-not-at-top  # plotting only
  matplotlib.use("Agg")  # a file, from a command: no display
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (heavy import)
  ms = [r["M"] for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
  axes[0].plot(ms, [r["variance_mean"] for r in rows], marker="o")
  axes[0].set(xscale="log", xlabel="M", ylabel="Var[log Z_M] (mean over prompts)")
  axes[1].plot(ms, [r["relative_bias_mean"] for r in rows], marker="o")
  axes[1].set(xscale="log", xlabel="M", ylabel="|Z_M - Z_pool| / Z_pool")
  for ax in axes:
    ax.set_xticks(ms, [str(m) for m in ms])
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


@dataclasses.dataclass(frozen=True)
class NStudyResult:
  """The App. C.3 study: what `run_nstudy` returns, persisted as ``<output_dir>/nstudy.json``
  (with ``subset.json``, the subset's description, and the pool's Stage 1 output in ``stage1/``).

  Attributes:
    output_dir: the study's directory.
    prompts: the subset's prompts; prompts_with_full_pool: those with ``pool_size`` samples.
    pool_size, repeats: samples per prompt in the pool, and subsamples per M.
    per_m: ``[len(ms)]`` one row per M (``M``, ``variance_mean``, ``relative_bias_mean``, ...;
      `disa_jax.estimators.nstudy.NStudy.summary`).
    variance_reduction_2_to_8, relative_bias_change_8_to_16: the paper's two figures (None when
      the Ms lack 2 and 8, or 8 and 16).
    k: the clusters of the stratified subset (the SSE elbow).
    stage1: the pool's Stage 1 output.
  """
  output_dir: Path = codec.field(stored=False)
  prompts: int
  prompts_with_full_pool: int
  pool_size: int
  repeats: int
  per_m: tuple[Mapping[str, float], ...]
  variance_reduction_2_to_8: float | None = codec.field(omit=None)
  relative_bias_change_8_to_16: float | None = codec.field(omit=None)
  k: int
  stage1: Stage1Result

  FILE = "nstudy.json"

  def study_json(self) -> dict[str, Any]:
    """nstudy.json's content."""
    return codec.encode(self, omit=("k", "stage1"))

  def to_json(self) -> dict[str, Any]:
    """What the command prints: nstudy.json, the subset's k and the pool's Stage 1 summary."""
    return codec.encode(self)

  @classmethod
  def load(cls, output_dir: str | Path) -> "NStudyResult":
    out = Path(output_dir)
    path, subset = out / cls.FILE, out / "subset.json"
    k = artifacts.field(artifacts.read_json(subset, "the N-study subset"), "k", subset, int)
    study = artifacts.read_json(path, "the N-study")
    return codec.decode(cls, study, path, output_dir=out, k=k,
                        stage1=Stage1Result.load(out / "stage1"))


def run_nstudy(cfg: NStudyConfig) -> NStudyResult:
  """Subset -> Stage 1 pool -> statistics; resumable. Returns the study (`NStudyResult`:
  ``nstudy.json``'s content, the subset's k and the pool's Stage 1 output)."""
  out = Path(cfg.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  claim_nstudy_output(cfg)
  artifacts.write_json(out / "nstudy_config.json", config_lib.to_dict(cfg))
  subset = choose_subset(cfg)
  stage1 = run_stage1(cfg.pool_config())
  if stage1.preempted:
    raise RuntimeError(f"the N-study's Stage 1 pool {stage1.dataset} was stopped by a preemption "
                       "signal; rerun the command to resume")
  return codec.decode(NStudyResult, study_pool(cfg), out / NStudyResult.FILE, output_dir=out,
                      k=subset["k"], stage1=stage1)
