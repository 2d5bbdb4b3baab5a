"""Stage 2: fit g_psi to the Stage 1 labels by least squares (paper eq. 7), then freeze it.

    psi* = argmin_psi  E_{q ~ D_Z} [ (g_psi(q) - log Z_IS(q))^2 ]                     (eq. 7)

Defaults follow Table 6: Adam with learning rate 1e-3, batch 1024, 80 epochs. A held-out split gives
the per-epoch validation MSE and R^2 (the separable diagnostic of §2.2) and the best epoch is kept.
Optional per-prompt weights turn eq. (7) into weighted least squares (e.g. inverse label variance).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from disa_jax.anchor.frozen import Anchor, AnchorMeta, EmbeddingSpec
from disa_jax.anchor.mlp import AnchorMLP
from disa_jax.estimators.reward_transforms import RewardTransform


@dataclasses.dataclass(frozen=True)
class AnchorFitConfig:
  """Stage 2 hyper-parameters (paper Table 6 defaults)."""

  hidden_sizes: tuple[int, ...] = (64,)  # (64,) = two-layer MLP, hidden width 64
  activation: str = "relu"
  learning_rate: float = 1e-3  # Adam
  batch_size: int = 1024
  epochs: int = 80
  val_fraction: float = 0.1  # held-out share of prompts; 0 disables validation (last epoch kept)
  seed: int = 0

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"AnchorFitConfig.learning_rate must be > 0, got {self.learning_rate!r}")
    if self.batch_size < 1:
      raise ValueError(f"AnchorFitConfig.batch_size must be >= 1, got {self.batch_size!r}")
    if self.epochs < 1:
      raise ValueError(f"AnchorFitConfig.epochs must be >= 1, got {self.epochs!r}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f"AnchorFitConfig.val_fraction must be in [0, 1), got {self.val_fraction!r}")


@dataclasses.dataclass
class FitResult:
  """The frozen anchor plus the fit's history and split."""

  anchor: Anchor
  history: dict[str, list[float]]  # per epoch: train_mse, val_mse, val_r2
  best_epoch: int  # 0-based
  train_idx: np.ndarray
  val_idx: np.ndarray

  def summary(self) -> dict[str, Any]:
    e = self.best_epoch
    h = self.history
    return {"best_epoch": e, "train_mse": h["train_mse"][e],
            "val_mse": h["val_mse"][e] if h["val_mse"] else None,
            "val_r2": h["val_r2"][e] if h["val_r2"] else None,
            "n_train": int(len(self.train_idx)), "n_val": int(len(self.val_idx))}


def _check_inputs(x: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> None:
  if x.ndim != 2:
    raise ValueError(f"embeddings must be [P, D], got shape {x.shape}")
  if y.shape != (x.shape[0],):
    raise ValueError(f"labels must be [P={x.shape[0]}], got shape {y.shape}")
  bad = np.flatnonzero(~np.isfinite(y))
  if bad.size:
    raise ValueError(f"labels contain {bad.size} non-finite value(s) (NaN: no valid Stage 1 sample; -inf: all "
                     f"weights zero) at prompt index(es) {bad[:10].tolist()}; values {y[bad[:10]].tolist()}. "
                     f"Drop or re-sample those prompts before fitting.")
  badx = np.flatnonzero(~np.isfinite(x).all(axis=1))
  if badx.size:
    raise ValueError(f"embeddings contain non-finite values at prompt index(es) {badx[:10].tolist()}")
  if w is not None:
    if w.shape != y.shape or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
      raise ValueError(f"sample_weights must be [P] finite, >= 0 and not all zero; got shape {w.shape}")


def fit_anchor(embeddings: np.ndarray,
               labels: np.ndarray,
               *,
               embedding: EmbeddingSpec | None = None,
               beta: float,
               reward_transform: RewardTransform,
               label_scale: str,
               config: AnchorFitConfig = AnchorFitConfig(),
               sample_weights: np.ndarray | None = None,
               label_kind: str = "log_z_is",
               val_idx: Sequence[int] | None = None) -> FitResult:
  """Fits and freezes the anchor.

  Args:
    embeddings: ``[P, D]`` frozen prompt embeddings.
    labels: ``[P]`` log Z_IS labels (eq. 6); must be finite (a clear error names bad indices).
    embedding: the spec of the embeddings (defaults to 'precomputed' with D = embeddings.shape[1]).
    beta, reward_transform, label_scale: facts of the labels, recorded in the anchor.
    config: `AnchorFitConfig`.
    sample_weights: optional ``[P]`` non-negative weights (weighted least squares).
    label_kind: name of the label variant, recorded.
    val_idx: optional explicit held-out indices (otherwise a random ``val_fraction`` split).

  Returns:
    `FitResult` with the best-epoch anchor.
  """
  x = np.asarray(embeddings, np.float32)
  y = np.asarray(labels, np.float64)
  w = None if sample_weights is None else np.asarray(sample_weights, np.float64)
  _check_inputs(x, y, w)
  p, d = x.shape
  embedding = embedding or EmbeddingSpec(source="precomputed", dim=d)
  if embedding.dim != d:
    raise ValueError(f"embedding spec dim {embedding.dim} != embeddings width {d}")
  rng = np.random.default_rng(config.seed)
  if val_idx is not None:
    val = np.unique(np.asarray(val_idx, np.int64))
    if val.size and (val.min() < 0 or val.max() >= p):
      raise ValueError(f"val_idx out of range [0, {p})")
  else:
    n_val = int(round(config.val_fraction * p))
    val = np.sort(rng.permutation(p)[:n_val]) if n_val else np.zeros((0,), np.int64)
  train = np.setdiff1d(np.arange(p), val)
  if train.size < 2:
    raise ValueError(f"need at least 2 training prompts, got {train.size} (P={p}, val={val.size})")

  mlp = AnchorMLP(d, config.hidden_sizes, config.activation, rngs=nnx.Rngs(config.seed))
  mlp.set_standardization(jnp.asarray(x[train]), jnp.asarray(y[train], jnp.float32))
  graphdef, params, rest = nnx.split(mlp, nnx.Param, ...)
  tx = optax.adam(config.learning_rate)
  opt_state = tx.init(params)

  wt = np.ones(p) if w is None else w / w[train].mean()  # weights normalised to mean 1 on train
  xs, ys, ws = jnp.asarray(x), jnp.asarray(y, jnp.float32), jnp.asarray(wt, jnp.float32)
  bs = min(config.batch_size, train.size)
  n_batches = math.ceil(train.size / bs)

  def batch_loss(params, xb, yb, wb):
    model = nnx.merge(graphdef, params, rest)
    z = (yb - model.y_mean.value) / model.y_std.value  # labels in standardised units
    return jnp.sum(wb * (model.normalized(xb) - z) ** 2) / jnp.maximum(jnp.sum(wb), 1e-12)

  @jax.jit
  def epoch(params, opt_state, order):
    # order: [n_batches, bs] indices into the prompts, -1 for padding of the last batch.
    def step(carry, idx):
      params, opt_state = carry
      valid = (idx >= 0).astype(jnp.float32)
      safe = jnp.maximum(idx, 0)
      loss, grads = jax.value_and_grad(batch_loss)(params, xs[safe], ys[safe], ws[safe] * valid)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss
    (params, opt_state), _ = jax.lax.scan(step, (params, opt_state), order)
    return params, opt_state

  @jax.jit
  def predict(params, xb):
    return nnx.merge(graphdef, params, rest)(xb)

  hist = {"train_mse": [], "val_mse": [], "val_r2": []}
  best, best_score, best_params = 0, np.inf, params
  y_val = y[val]
  for e in range(config.epochs):
    perm = rng.permutation(train)
    order = np.full(n_batches * bs, -1, np.int64)
    order[:train.size] = perm
    params, opt_state = epoch(params, opt_state, jnp.asarray(order.reshape(n_batches, bs)))  # [n_batches, bs]
    pred = np.asarray(predict(params, xs), np.float64)
    hist["train_mse"].append(float(np.mean((pred[train] - y[train]) ** 2)))
    if val.size:
      mse = float(np.mean((pred[val] - y_val) ** 2))
      sst = float(np.mean((y_val - y_val.mean()) ** 2))
      hist["val_mse"].append(mse)
      hist["val_r2"].append(1.0 - mse / sst if sst > 0 else float("nan"))
      score = mse
    else:
      score = -e  # no validation: keep the last epoch
    if score < best_score:
      best, best_score, best_params = e, score, params

  final = nnx.merge(graphdef, best_params, rest)
  meta = AnchorMeta(embedding=embedding, beta=float(beta), reward_transform=reward_transform,
                    label_scale=label_scale, hidden_sizes=tuple(config.hidden_sizes),
                    activation=config.activation, label_kind=label_kind)
  result = FitResult(anchor=Anchor(final, meta), history=hist, best_epoch=best, train_idx=train, val_idx=val)
  result.anchor.meta = dataclasses.replace(meta, fit_summary=result.summary())
  return result
