"""The Stage 2 command on real checkpoints: reference embeddings -> anchor fit -> frozen anchor.

`run_stage2(Stage2Config)` loads the Stage 1 dataset, re-encodes its prompts exactly as Stage 1 did
(the prompt file, limit and rendering recorded in Stage 1's ``stage1_config.json``, through
`disa_jax.data.prompting.encode_prompt`, the encoder Stage 3 uses too; the rendered text must equal
what Stage 1 stored), embeds them with the reference model (the masked mean of its final hidden
state over the prompt tokens, as the Stage 3 scorer does), computes the regression targets with
`disa_jax.anchor.labels` (plain log Z_IS of eq. 8, or the Jensen / jackknife variants; uniform or
inverse-variance weights; optionally from the first N samples of each prompt), fits g_psi by least
squares (eq. 9; Table 6 defaults), and writes:

    <output_dir>/embeddings.npy, embeddings_ids.json   the embedding cache (reused by a rerun)
    <output_dir>/validation_curve.png                  train / held-out MSE and R^2 per epoch
    <output_dir>/stage2_summary.json                   fit summary, history, label statistics
    <anchor_path>/                                     the frozen `Anchor` (orbax + metadata, with
                                                       the reference (path and content fingerprint)
                                                       and rendering it was fitted on)

``<output_dir>/stage2_identity.json`` records what the anchor was fitted from (the Stage 1 dataset
and the reference with content hashes, the label variant, weighting, samples, fit and embedding
settings; `disa_jax.checkpoint.identity`: inputs compared by content, ``anchor_path`` recorded but
not compared, so an output copied elsewhere with its inputs resumes); a rerun with other inputs
stops naming every differing field (``overwrite=True`` deletes the old anchor, summary and embedding
cache and fits afresh). One run at a time holds ``<output_dir>/.lock``. Any of these paths may be
a URL (``gs://``, `disa_jax.paths`); the reference model is a local directory.
A rerun with the same identity finds the anchor and the summary and returns the stored summary without refitting. A run
killed between saving the anchor and writing the summary left ``stage2_pending.json`` naming the
anchor: the rerun removes that anchor and fits again (the same anchor: the fit is seeded). Every file
is written through a temporary name and renamed into place.
Prompts whose label is not finite (no valid Stage 1 sample) are dropped only when
``drop_nonfinite`` is set, and the summary lists them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import estimators, paths, preemption
from disa_jax.anchor import Anchor, diagnostics, fit_anchor
from disa_jax.anchor.embeddings import embed_prompts
from disa_jax.anchor.fit import AnchorFitConfig
from disa_jax.anchor.frozen import EmbeddingSpec, META_FILE
from disa_jax.anchor.labels import LABEL_KINDS, anchor_targets, check_variant
from disa_jax.checkpoint import identity
from disa_jax.checkpoint.lock import owned_output
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.tasks.prompts import load_prompts
from disa_jax.workflows.pinned_prompts import check_stage1_prompts
from disa_jax.workflows.stage1 import ScorerConfig, encode_stage1_prompts, load_reference


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage2Config:
  """Typed view of `configs/stage2_paper.py` (the fields are documented there)."""

  stage1_path: str
  reference_path: str
  anchor_path: str
  output_dir: str
  stage1_format: str = "auto"
  samples: int = 0
  labels: str = "plain"
  weighting: str = "uniform"
  drop_nonfinite: bool = False
  exclude_prompts_path: str = ""
  fit: AnchorFitConfig = AnchorFitConfig()
  embedding: ScorerConfig = ScorerConfig()
  overwrite: bool = False

  def __post_init__(self):
    for name in ("stage1_path", "reference_path", "anchor_path", "output_dir"):
      if not getattr(self, name):
        raise ValueError(f"{name} is required (a local path), got ''")
    check_variant(self.labels, self.weighting, 1e-3)
    if self.samples < 0:
      raise ValueError(f"samples must be >= 0 (0 = all of Stage 1's), got {self.samples!r}")

  @classmethod
  def from_config(cls, config: Any) -> "Stage2Config":
    """From a ConfigDict / dict (unknown fields and bad values raise, naming the field)."""
    return config_lib.from_mapping(cls, config)


def plot_validation_curve(history: dict[str, list[float]], best_epoch: int, path: Path) -> None:
  """Train / held-out MSE per epoch (log scale), held-out R^2 on a twin axis, best epoch starred."""
  import matplotlib  # pylint: disable=g-import-not-at-top  (heavy import, plots only)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (heavy import)
  epochs = np.arange(1, len(history["train_mse"]) + 1)
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(epochs, history["train_mse"], label="train MSE")
  if history["val_mse"]:
    ax.plot(epochs, history["val_mse"], label="val MSE")
    ax.plot([best_epoch + 1], [history["val_mse"][best_epoch]], "*", ms=14, label="selected")
    ax2 = ax.twinx()
    ax2.plot(epochs, history["val_r2"], "g:", label="val $R^2$")
    ax2.set_ylabel("val $R^2$")
  ax.set_yscale("log")
  ax.set_xlabel("epoch")
  ax.set_ylabel("MSE on log Z_IS")
  ax.set_title("Stage 2 anchor fit")
  ax.legend(loc="upper right")
  fig.tight_layout()
  with paths.as_path(path).open("wb") as f:
    fig.savefig(f, format="png", dpi=120)
  plt.close(fig)


def _embeddings(cfg: Stage2Config, data, out_dir: Path):
  """``[P, D]`` reference embeddings of the Stage 1 prompts (cached in ``out_dir``), and the spec."""
  token_ids, rendering = encode_stage1_prompts(cfg.stage1_path, cfg.reference_path, data)
  cache, ids_file = out_dir / "embeddings.npy", out_dir / "embeddings_ids.json"
  key = {"reference_path": cfg.reference_path, "dtype": cfg.embedding.dtype,
         "rendering": rendering, "prompt_ids": data.prompt_ids}
  if cache.exists() and ids_file.exists() and json.loads(ids_file.read_text()) == key:
    emb = _load_npy(cache)
  else:
    ids_file.unlink(missing_ok=True)  # the key is written last: a cache without it is stale
    tok = load_tokenizer(cfg.reference_path)
    model = load_reference(cfg.reference_path, cfg.embedding)
    emb, _ = embed_prompts(model, token_ids, pad_id=int(tok.pad_token_id),
                           batch_size=cfg.embedding.batch_size, pad_to=cfg.embedding.pad_to,
                           row_len=cfg.embedding.row_len, packing=cfg.embedding.packing)
    with (out_dir / "embeddings.tmp.npy").open("wb") as f:
      np.save(f, emb)
    paths.replace(out_dir / "embeddings.tmp.npy", cache)
    artifacts.write_json(ids_file, key)
  spec = EmbeddingSpec(source="model_mean_pool", dim=int(emb.shape[1]),
                       model_path=cfg.reference_path, prompt_format="stage1_prompt",
                       rendering=rendering, model_sha256=identity.fingerprint(cfg.reference_path))
  return emb, spec


def _load_npy(path: paths.AnyPath) -> np.ndarray:
  """The array of a ``.npy`` file (local or a URL)."""
  with path.open("rb") as f:
    return np.load(f)


@dataclasses.dataclass(frozen=True)
class FitSummary:
  """The anchor fit at its selected epoch (`disa_jax.anchor.fit.FitResult.summary`)."""
  best_epoch: int
  train_mse: float
  val_mse: float | None
  val_r2: float | None
  n_train: int
  n_val: int


@dataclasses.dataclass(frozen=True)
class AnchorArtifact:
  """Stage 2's output: what `run_stage2` returns, persisted as ``<output_dir>/stage2_summary.json``
  beside the embedding cache, with the frozen anchor at ``anchor_path``.

  Attributes:
    output_dir: the Stage 2 directory (summary, embedding cache, validation curve).
    anchor_path: the frozen `Anchor` (`anchor()` loads it).
    stage1_path: the Stage 1 dataset the labels came from.
    prompts, prompts_fitted: Stage 1's prompts, and those the fit used (P): a finite label, not
      excluded (``exclude_prompts_path``).
    samples_per_prompt: N, the samples per prompt the labels used.
    dropped_nonfinite: the prompts without a finite label (dropped with ``drop_nonfinite``).
    embedding: what the anchor reads (`EmbeddingSpec`).
    beta, label_scale, reward_transform: the label facts (`disa_jax.anchor.labels`).
    labels, weighting: the label variant and the regression weights.
    label_stats: mean / std / min / max of the fitted labels.
    fit: the fit at its selected epoch; history: per epoch, ``train_mse`` / ``val_mse`` /
      ``val_r2`` (each ``[E]``; the val curves empty without a held-out split).
    val_prompt_ids: the held-out prompts of the fit.
    sigma_g_train, sigma_g_val: RMS(g - label) on the training / held-out prompts (None: none).
    validation_curve: the PNG of the fit's curves.
    resumed: the call that returned it found the fit done.
  """
  output_dir: Path = codec.field(stored=False)
  anchor_path: Path
  stage1_path: str
  prompts: int
  prompts_fitted: int
  samples_per_prompt: int
  dropped_nonfinite: tuple[str, ...]
  embedding: EmbeddingSpec
  beta: float
  label_scale: str
  labels: str
  weighting: str
  reward_transform: RewardTransform
  label_stats: Mapping[str, float]
  fit: FitSummary
  val_prompt_ids: tuple[str, ...]
  sigma_g_train: float
  sigma_g_val: float | None
  history: Mapping[str, list[float]]
  validation_curve: str
  resumed: bool

  FILE = "stage2_summary.json"

  def anchor(self) -> Anchor:
    return Anchor.load(self.anchor_path)

  def embeddings(self) -> tuple[tuple[str, ...], np.ndarray]:
    """The embedding cache: the prompt ids ``[P]`` and their reference embeddings ``[P, D]``."""
    ids_path, cache = self.output_dir / "embeddings_ids.json", self.output_dir / "embeddings.npy"
    ids = artifacts.str_tuple(artifacts.read_json(ids_path, "the Stage 2 embedding cache"),
                              "prompt_ids", ids_path)
    if not cache.is_file():
      raise artifacts.ArtifactError(f"the Stage 2 embedding cache: {cache} does not exist")
    emb = _load_npy(cache)
    if emb.ndim != 2 or emb.shape[0] != len(ids):
      raise artifacts.ArtifactError(f"{cache}: shape {emb.shape} is not [P = {len(ids)}, D] "
                                    f"({ids_path} lists {len(ids)} prompts)")
    return ids, emb

  def predictions(self) -> dict[str, float]:
    """g(q) of every prompt of the embedding cache, by prompt id."""
    ids, emb = self.embeddings()
    return dict(zip(ids, np.asarray(self.anchor()(emb), np.float64).tolist()))

  def to_json(self) -> dict[str, Any]:
    return codec.encode(self)

  def save(self) -> None:
    codec.save(self, self.output_dir / self.FILE)

  @classmethod
  def load(cls, output_dir: str | Path) -> "AnchorArtifact":
    """The Stage 2 output in ``output_dir`` (``resumed`` as its run stored it)."""
    return codec.load(cls, paths.as_path(output_dir) / cls.FILE, "the Stage 2 anchor",
                      output_dir=paths.as_path(output_dir))


IDENTITY_FIELDS = ("stage1_format", "samples", "labels", "weighting", "drop_nonfinite", "fit",
                   "embedding", "anchor_path")


def claim_stage2_output(cfg: Stage2Config) -> str:
  """Records (or checks) the identity of ``cfg``'s inputs in ``stage2_identity.json``; returns
  `disa_jax.checkpoint.identity.claim_output`'s state ('new' | 'resumed' | 'overwritten')."""
  out_dir, anchor_dir = paths.as_path(cfg.output_dir), paths.as_path(cfg.anchor_path)
  config = config_lib.to_dict(cfg)
  ident = {**identity.inputs(stage1_path=cfg.stage1_path, reference_path=cfg.reference_path),
           **{f: config[f] for f in IDENTITY_FIELDS}}
  if cfg.exclude_prompts_path:  # (only when set: identities written before the field stay valid)
    ident["excluded_prompt_ids"] = sorted(excluded_prompt_ids(cfg))
  outputs = [out_dir / n for n in ("stage2_summary.json", "stage2_pending.json", "embeddings.npy",
                                   "embeddings_ids.json", "validation_curve.png")]

  return identity.claim_output(out_dir / "stage2_identity.json", ident, overwrite=cfg.overwrite,
                               has_output=(anchor_dir / META_FILE).exists()
                               or any(f.exists() for f in outputs),
                               discard=lambda: identity.remove_paths([anchor_dir, *outputs]),
                               locations=("anchor_path",))


def excluded_prompt_ids(cfg: Stage2Config) -> frozenset[str]:
  """The prompt ids of ``cfg.exclude_prompts_path`` (none when unset)."""
  if not cfg.exclude_prompts_path:
    return frozenset()
  return frozenset(r.prompt_id for r in load_prompts(cfg.exclude_prompts_path))


def _fitted_prompts(cfg: Stage2Config, data: Any, labels: np.ndarray
                    ) -> tuple[np.ndarray, list[str]]:
  """(indices of the prompts the fit uses ``[P_kept]``, the prompts dropped for a non-finite
  label): every Stage 1 prompt but the excluded ones and, with ``drop_nonfinite``, those without a
  finite label (else an error names them)."""
  excluded = excluded_prompt_ids(cfg)
  unknown = sorted(excluded - set(data.prompt_ids))
  if unknown:
    raise ValueError(f"exclude_prompts_path={cfg.exclude_prompts_path!r}: {len(unknown)} prompt "
                     f"id(s) are not in the Stage 1 dataset {cfg.stage1_path!r}: {unknown[:10]}")
  fitted = np.array([pid not in excluded for pid in data.prompt_ids], bool)
  finite = np.isfinite(labels)
  dropped = [data.prompt_ids[i] for i in np.flatnonzero(fitted & ~finite)]
  if dropped and not cfg.drop_nonfinite:
    raise ValueError(f"{len(dropped)} Stage 1 prompt(s) have non-finite labels (no valid "
                     f"sample, or all weights zero): {dropped[:10]}; rerun Stage 1 for them or "
                     f"set drop_nonfinite=True")
  return np.flatnonzero(fitted & finite), dropped


def run_stage2(cfg: Stage2Config) -> AnchorArtifact:
  """Runs (or finds finished) Stage 2; returns its output (`AnchorArtifact`, persisted as
  ``stage2_summary.json``).

  Raises:
    preemption.Stopped: a SIGTERM / SIGUSR1 arrived before the fit; the embedding pass is cached
      (the signal is acted on once the pass is done) and a rerun fits from it.
    OutputLockedError: another Stage 2 run holds ``output_dir``.
    IdentityMismatchError: ``output_dir`` holds a fit of other inputs and ``overwrite`` is off.
  """
  out_dir = paths.as_path(cfg.output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  with preemption.watch(), owned_output(out_dir / ".lock", f"the Stage 2 output {out_dir}",
                                        lambda: claim_stage2_output(cfg)):
    return _run_stage2(cfg)


def _run_stage2(cfg: Stage2Config) -> AnchorArtifact:
  """`run_stage2` once the output is locked and its identity checked."""
  check_stage1_prompts(cfg.stage1_path)  # the labels were graded against that prompt file
  out_dir = paths.as_path(cfg.output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  summary_path = out_dir / "stage2_summary.json"
  pending = out_dir / "stage2_pending.json"
  anchor_dir = paths.as_path(cfg.anchor_path)
  if pending.exists() and json.loads(pending.read_text())["anchor_path"] == str(
      anchor_dir.resolve()) and not summary_path.exists():
    paths.remove(anchor_dir)  # saved by a run killed before its summary
  if (anchor_dir / META_FILE).exists():
    if not summary_path.exists():
      raise FileExistsError(f"{anchor_dir} already holds an anchor but {summary_path} is missing; "
                            f"choose a new anchor_path or output_dir")
    # The anchor where this run finds it (a copied output names its old place).
    out = dataclasses.replace(AnchorArtifact.load(out_dir), resumed=True,
                              anchor_path=anchor_dir.resolve())
    out.anchor()  # the stored anchor must load
    return out

  data = estimators.load_stage1(cfg.stage1_path, cfg.stage1_format)
  labels, weights = anchor_targets(data, cfg.labels, cfg.weighting, samples=cfg.samples)  # [P]
  idx, dropped = _fitted_prompts(cfg, data, labels)
  emb_all, spec = _embeddings(cfg, data, out_dir)
  if preemption.agreed():  # the embedding pass is cached: the rerun fits from it
    raise preemption.Stopped(f"stage2: preempted ({preemption.requested()}) after the embedding "
                             f"pass, cached in {out_dir / 'embeddings.npy'}; rerun the command to "
                             "fit the anchor")
  emb, y = emb_all[idx], labels[idx]  # [P_kept, D], [P_kept]
  res = fit_anchor(emb, y, embedding=spec, beta=data.beta, reward_transform=data.reward_transform,
                   label_scale=data.label_scale, config=cfg.fit,
                   sample_weights=None if weights is None else weights[idx],
                   label_kind=LABEL_KINDS[cfg.labels])
  plot_validation_curve(res.history, res.best_epoch, out_dir / "validation_curve.png")
  pred = np.asarray(res.anchor(emb), np.float64)  # [P_kept]
  artifacts.write_json(pending, {"anchor_path": str(anchor_dir.resolve())})
  res.anchor.save(anchor_dir)
  out = AnchorArtifact(
      output_dir=out_dir, anchor_path=anchor_dir.resolve(), stage1_path=cfg.stage1_path,
      prompts=int(len(data.prompt_ids)), prompts_fitted=int(idx.size),
      samples_per_prompt=int(cfg.samples or data.mask.shape[1]),
      dropped_nonfinite=tuple(dropped), embedding=spec, beta=data.beta,
      label_scale=data.label_scale, labels=cfg.labels, weighting=cfg.weighting,
      reward_transform=data.reward_transform,
      label_stats={"mean": float(y.mean()), "std": float(y.std()), "min": float(y.min()),
                   "max": float(y.max())},
      fit=FitSummary(**res.summary()),
      val_prompt_ids=tuple(data.prompt_ids[idx[i]] for i in res.val_idx),
      sigma_g_train=diagnostics.sigma_g(pred[res.train_idx], y[res.train_idx]),
      sigma_g_val=(diagnostics.sigma_g(pred[res.val_idx], y[res.val_idx])
                   if res.val_idx.size else None),
      history=res.history, validation_curve=str(out_dir / "validation_curve.png"), resumed=False)
  out.save()
  pending.unlink()
  return out
