"""Stage 2: fit g_psi to the Stage 1 labels by least squares (paper eq. 9), then freeze it.

    psi* = argmin_psi  E_{q ~ D_Z} [ (g_psi(q) - log Z_IS(q))^2 ]                     (eq. 9)

Defaults follow Table 6: Adam with learning rate 1e-3, batch 1024, 80 epochs. A held-out split gives
the per-epoch validation MSE and R^2 (the separable diagnostic of §2.2) and the best epoch is kept.
Optional per-prompt weights turn eq. (9) into weighted least squares (e.g. inverse label variance), and
``huber_delta > 0`` into a robust (Huber) fit. `fit_anchor_many` trains many such fits at once (vmapped),
e.g. the cross-validation folds of the sigma_g study (`disa_jax.pipeline.anchor_study`).
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
  # 0: least squares (eq. 9). > 0: Huber loss with this threshold in standardised label units, i.e.
  # squared below it and linear above, so a few far-off labels (e.g. a prompt whose N samples missed
  # every high-reward output, whose log Z_IS is ~beta too low) pull the fit less.
  huber_delta: float = 0.0

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(f"AnchorFitConfig.learning_rate must be > 0, got {self.learning_rate!r}")
    if self.batch_size < 1:
      raise ValueError(f"AnchorFitConfig.batch_size must be >= 1, got {self.batch_size!r}")
    if self.epochs < 1:
      raise ValueError(f"AnchorFitConfig.epochs must be >= 1, got {self.epochs!r}")
    if not 0.0 <= self.val_fraction < 1.0:
      raise ValueError(f"AnchorFitConfig.val_fraction must be in [0, 1), got {self.val_fraction!r}")
    if not self.huber_delta >= 0.0:
      raise ValueError(f"AnchorFitConfig.huber_delta must be >= 0, got {self.huber_delta!r}")


def residual_loss(resid: jax.Array, huber_delta: float) -> jax.Array:
  """Per-example loss of the standardised residual: resid^2 (eq. 9), or 2 x Huber(resid; delta) if delta > 0.

  The Huber branch is scaled by 2 so that both agree (resid^2) for |resid| <= delta.

  Args:
    resid: ``[B]`` residuals g - label in standardised units.
    huber_delta: 0 for least squares, else the Huber threshold.

  Returns:
    ``[B]`` losses.
  """
  if huber_delta == 0.0:
    return resid ** 2
  a = jnp.abs(resid)
  return jnp.where(a <= huber_delta, resid ** 2, 2.0 * huber_delta * a - huber_delta ** 2)


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
    labels: ``[P]`` log Z_IS labels (eq. 8); must be finite (a clear error names bad indices).
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
    loss = residual_loss(model.normalized(xb) - z, config.huber_delta)  # [B]
    return jnp.sum(wb * loss) / jnp.maximum(jnp.sum(wb), 1e-12)

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


def fit_anchor_many(embeddings: np.ndarray,
                    labels: np.ndarray,
                    train_mask: np.ndarray,
                    *,
                    config: AnchorFitConfig = AnchorFitConfig(),
                    sample_weights: np.ndarray | None = None,
                    val_mask: np.ndarray | None = None) -> np.ndarray:
  """Fits F anchors on the same prompts at once (vmapped), each with its own labels, weights and rows.

  Every fit is the eq. (9) fit of `fit_anchor` on its training rows: the same `AnchorMLP`, the same
  initialisation (``nnx.Rngs(config.seed)``, shared by all fits), standardisation on its own training
  rows, Adam, minibatches of ``min(batch_size, n_train)`` in a fresh random order each epoch, and the
  same loss (``config.huber_delta``). With ``val_mask`` the epoch with the lowest unweighted MSE
  against the labels on the fit's validation rows is kept, as `fit_anchor` does with ``val_idx``;
  without it the last epoch is kept, as `fit_anchor` does with ``val_fraction=0``. Rows in neither mask
  are never seen, so they measure the anchor's error honestly (cross-validation). Fits with fewer
  minibatches than the largest skip the missing steps (no Adam update), so each fit takes exactly its
  own ``epochs * ceil(n_train / batch)`` steps. Only the shuffling differs from `fit_anchor` (its
  full-batch fits are reproduced to float32 rounding).

  Args:
    embeddings: ``[P, D]`` frozen prompt embeddings, shared by all fits.
    labels: ``[F, P]`` labels per fit; must be finite on each fit's training and validation rows.
    train_mask: ``[F, P]`` bool, the training rows of each fit (at least 2 per fit).
    config: `AnchorFitConfig` (``val_fraction`` is not used: the split is ``train_mask`` / ``val_mask``).
    sample_weights: optional ``[F, P]`` non-negative weights (weighted least squares), finite with a
      positive sum on each fit's training rows.
    val_mask: optional ``[F, P]`` bool validation rows for best-epoch selection, disjoint from
      ``train_mask``, at least one per fit.

  Returns:
    ``[F, P]`` float64 predictions g_psi(q) of every fit's kept anchor on all P prompts.
  """
  x = np.asarray(embeddings, np.float32)
  y = np.asarray(labels, np.float64)
  tm = np.asarray(train_mask, bool)
  if x.ndim != 2:
    raise ValueError(f"embeddings must be [P, D], got shape {x.shape}")
  p, d = x.shape
  if y.ndim != 2 or y.shape[1] != p or tm.shape != y.shape:
    raise ValueError(f"labels and train_mask must both be [F, P={p}], got {y.shape} and {tm.shape}")
  vm = np.zeros_like(tm) if val_mask is None else np.asarray(val_mask, bool)
  if vm.shape != tm.shape:
    raise ValueError(f"val_mask must be [F, P] = {tm.shape}, got {vm.shape}")
  if (vm & tm).any():
    raise ValueError(f"val_mask overlaps train_mask at (fit, prompt) {np.argwhere(vm & tm)[:10].tolist()}")
  if val_mask is not None and not vm.any(1).all():
    raise ValueError(f"val_mask: every fit needs at least 1 validation prompt; fit {int(vm.sum(1).argmin())} has 0")
  if not np.isfinite(x).all():
    raise ValueError("embeddings contain non-finite values at prompt index(es) "
                     f"{np.flatnonzero(~np.isfinite(x).all(1))[:10].tolist()}")
  n_train = tm.sum(1)  # [F]
  if n_train.min() < 2:
    raise ValueError(f"train_mask: every fit needs at least 2 training prompts; fit {int(n_train.argmin())} has "
                     f"{int(n_train.min())}")
  bad = np.argwhere((tm | vm) & ~np.isfinite(y))
  if bad.size:
    raise ValueError(f"labels contain {len(bad)} non-finite value(s) on training/validation rows; (fit, prompt) "
                     f"{bad[:10].tolist()}, values {y[tuple(bad[:10].T)].tolist()}")
  w = np.ones_like(y) if sample_weights is None else np.asarray(sample_weights, np.float64)
  if w.shape != y.shape:
    raise ValueError(f"sample_weights must be [F, P] = {y.shape}, got {w.shape}")
  w = np.where(tm, w, 0.0)
  if not np.isfinite(w).all() or (w < 0).any() or not (w.sum(1) > 0).all():
    raise ValueError("sample_weights must be finite, >= 0 and not all zero on each fit's training rows")
  y = np.where(tm | vm, y, 0.0)
  f = y.shape[0]

  # Per-fit standardisation on the training rows (as AnchorMLP.set_standardization: population std).
  cnt = n_train[:, None].astype(np.float64)  # [F, 1]
  x_mean = (tm.astype(np.float64) @ x) / cnt  # [F, D]
  x_var = (tm.astype(np.float64) @ (x.astype(np.float64) ** 2)) / cnt - x_mean ** 2
  x_std = np.maximum(np.sqrt(np.maximum(x_var, 0.0)), 1e-6)
  y_tr = np.where(tm, y, 0.0)
  y_mean = y_tr.sum(1) / n_train  # [F]
  y_std = np.maximum(np.sqrt(np.sum(np.where(tm, (y - y_mean[:, None]) ** 2, 0.0), 1) / n_train), 1e-6)

  # Minibatch order: [epochs, steps, F, width] prompt indices, -1 for padding.
  rng = np.random.default_rng(config.seed)
  bs = np.minimum(config.batch_size, n_train)  # [F] per-fit batch size
  n_batches = -(-n_train // bs)  # [F] ceil
  steps, width = int(n_batches.max()), int(bs.max())
  keys = rng.random((config.epochs, f, p))
  keys[:, ~tm] = np.inf  # non-training rows sort last
  perm = np.argsort(keys, axis=-1)  # [E, F, P]: each fit's training rows first, in random order
  b_idx, k_idx = np.arange(steps)[:, None, None], np.arange(width)[None, None, :]  # [S, 1, 1], [1, 1, W]
  pos = b_idx * bs[None, :, None] + k_idx  # [S, F, W] position in the permutation
  ok = (k_idx < bs[None, :, None]) & (pos < n_train[None, :, None])  # [S, F, W]
  gathered = np.take_along_axis(perm[:, None], np.minimum(pos, p - 1)[None].repeat(config.epochs, 0), axis=-1)
  order = np.where(ok[None], gathered, -1)  # [E, S, F, W]

  mlp = AnchorMLP(d, config.hidden_sizes, config.activation, rngs=nnx.Rngs(config.seed))
  # The standardisers carry a leading fit axis ([F, D] and [F]); vmap maps them with the parameters.
  mlp.x_mean.value, mlp.x_std.value = jnp.asarray(x_mean, jnp.float32), jnp.asarray(x_std, jnp.float32)
  mlp.y_mean.value, mlp.y_std.value = jnp.asarray(y_mean, jnp.float32), jnp.asarray(y_std, jnp.float32)
  graphdef, params0, stats = nnx.split(mlp, nnx.Param, ...)
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (f,) + a.shape), params0)  # [F, ...] shared init
  tx = optax.adam(config.learning_rate)
  opt_state = jax.vmap(tx.init)(params)
  xs = jnp.asarray(x)

  def predict(prm, st):  # -> [P]
    return nnx.merge(graphdef, prm, st)(xs)

  def fit_step(prm, opt, st, idx, yf, wf):
    valid = idx >= 0  # [W]
    safe = jnp.maximum(idx, 0)

    def loss_fn(prm):
      model = nnx.merge(graphdef, prm, st)
      z = (yf[safe] - model.y_mean.value) / model.y_std.value  # labels in standardised units
      wb = wf[safe] * valid
      loss = residual_loss(model.normalized(xs[safe]) - z, config.huber_delta)  # [W]
      return jnp.sum(wb * loss) / jnp.maximum(jnp.sum(wb), 1e-12)

    grads = jax.grad(loss_fn)(prm)
    updates, new_opt = tx.update(grads, opt, prm)
    new_prm = optax.apply_updates(prm, updates)
    live = jnp.any(valid)  # an all-padding step (a fit with fewer minibatches) changes nothing
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)
    return keep(new_prm, prm), keep(new_opt, opt)

  select = val_mask is not None

  @jax.jit
  def train(params, opt_state, order, ys, ws, vmask):
    def epoch(carry, order_e):  # order_e: [S, F, W]
      prm, opt, best_prm, best_mse = carry
      def step(c, idx):  # idx: [F, W]
        return jax.vmap(fit_step)(*c, stats, idx, ys, ws), None
      (prm, opt), _ = jax.lax.scan(step, (prm, opt), order_e)
      if select:  # validation MSE of this epoch, per fit; keep the parameters of the best epoch so far
        pred = jax.vmap(predict)(prm, stats)  # [F, P]
        mse = jnp.sum(vmask * (pred - ys) ** 2, -1) / jnp.sum(vmask, -1)  # [F]
        better = mse < best_mse
        best_prm = jax.tree.map(lambda a, b: jnp.where(better.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                                prm, best_prm)
        best_mse = jnp.where(better, mse, best_mse)
      else:
        best_prm = prm
      return (prm, opt, best_prm, best_mse), None
    init = (params, opt_state, params, jnp.full((f,), jnp.inf, jnp.float32))
    (_, _, best_prm, _), _ = jax.lax.scan(epoch, init, order)
    return jax.vmap(predict)(best_prm, stats)  # [F, P]

  pred = train(params, opt_state, jnp.asarray(order, jnp.int32), jnp.asarray(y, jnp.float32),
               jnp.asarray(w, jnp.float32), jnp.asarray(vm, jnp.float32))
  return np.asarray(pred, np.float64)
