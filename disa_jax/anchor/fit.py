"""Stage 2: fit g_psi to the Stage 1 labels by least squares (paper eq. 9), then freeze it.

    psi* = argmin_psi  E_{q ~ D_Z} [ (g_psi(q) - log Z_IS(q))^2 ]                     (eq. 9)

Defaults follow Table 6: Adam with learning rate 1e-3, batch 1024, 80 epochs. A held-out split gives
the per-epoch validation MSE and R^2 (the separable diagnostic of §2.2) and the best epoch is kept.
Optional per-prompt weights turn eq. (9) into weighted least squares (e.g. inverse label variance), and
``huber_delta > 0`` into a robust (Huber) fit. `fit_anchor_many` trains many such fits at once (vmapped),
e.g. the cross-validation folds of the sigma_g study (`disa_jax.pipeline.anchor_study`); `fit_anchor` is
the same fit with F = 1 (one shared core, `_fit_core`), which also returns the history and the frozen anchor.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from disa_jax.anchor.frozen import Anchor, AnchorMeta, EmbeddingSpec
from disa_jax.anchor.mlp import AnchorMLP
from disa_jax.estimators.reward_transforms import RewardTransform


@dataclasses.dataclass(frozen=True, kw_only=True)
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


def _split(p: int, config: AnchorFitConfig, val_idx: Sequence[int] | None) -> tuple[np.ndarray, np.ndarray]:
  """`fit_anchor`'s train / validation split: ``val_idx`` if given, else a seeded ``val_fraction`` share.

  Returns:
    ``(train, val)``: sorted int64 prompt indices, ``[P - V]`` and ``[V]``.

  Raises:
    ValueError: ``val_idx`` out of range, or fewer than 2 training prompts.
  """
  if val_idx is not None:
    val = np.unique(np.asarray(val_idx, np.int64))
    if val.size and (val.min() < 0 or val.max() >= p):
      raise ValueError(f"val_idx out of range [0, {p})")
  else:
    n_val = int(round(config.val_fraction * p))
    val = np.sort(np.random.default_rng(config.seed).permutation(p)[:n_val]) if n_val else np.zeros((0,), np.int64)
  train = np.setdiff1d(np.arange(p), val)
  if train.size < 2:
    raise ValueError(f"need at least 2 training prompts, got {train.size} (P={p}, val={val.size})")
  return train, val


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
  """Fits and freezes the anchor: `fit_anchor_many` with one fit, plus its history and metadata.

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
    `FitResult` with the best-epoch anchor (the last epoch without a validation split).

  Raises:
    ValueError: bad shapes, non-finite labels or embeddings (naming the indices), bad weights, an
      embedding spec of another width, ``val_idx`` out of range, or fewer than 2 training prompts.
  """
  x = np.asarray(embeddings, np.float32)
  y = np.asarray(labels, np.float64)
  w = None if sample_weights is None else np.asarray(sample_weights, np.float64)
  _check_inputs(x, y, w)
  p, d = x.shape
  embedding = embedding or EmbeddingSpec(source="precomputed", dim=d)
  if embedding.dim != d:
    raise ValueError(f"embedding spec dim {embedding.dim} != embeddings width {d}")
  train, val = _split(p, config, val_idx)
  if w is not None and not w[train].sum() > 0:
    raise ValueError(f"sample_weights are all zero on the {train.size} training prompts (sum {w[train].sum()}); "
                     f"only the {val.size} validation prompts carry weight")
  tm, vm = np.zeros((1, p), bool), np.zeros((1, p), bool)
  tm[0, train], vm[0, val] = True, True
  fits = _fit_core(x, y[None], tm, vm, np.ones((1, p)) if w is None else w[None], config)
  hist = {"train_mse": fits.train_mse[0].tolist(),
          "val_mse": fits.val_mse[0].tolist() if val.size else [],
          "val_r2": fits.val_r2[0].tolist() if val.size else []}
  meta = AnchorMeta(embedding=embedding, beta=float(beta), reward_transform=reward_transform,
                    label_scale=label_scale, hidden_sizes=tuple(config.hidden_sizes),
                    activation=config.activation, label_kind=label_kind)
  result = FitResult(anchor=Anchor(fits.mlp(0), meta), history=hist, best_epoch=int(fits.best_epoch[0]),
                     train_idx=train, val_idx=val)
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

  Every fit is the eq. (9) fit of `fit_anchor` on its training rows (both run `_fit_core`): the same
  `AnchorMLP`, the same initialisation (``nnx.Rngs(config.seed)``, shared by all fits), standardisation
  on its own training rows, Adam, minibatches of ``min(batch_size, n_train)`` in a fresh random order
  each epoch, and the same loss (``config.huber_delta``). With ``val_mask`` the epoch with the lowest
  unweighted MSE against the labels on the fit's validation rows is kept, as `fit_anchor` does with
  ``val_idx``; without it the last epoch is kept, as `fit_anchor` does with ``val_fraction=0``. Rows in
  neither mask are never seen, so they measure the anchor's error honestly (cross-validation). Fits with
  fewer minibatches than the largest skip the missing steps (no Adam update), so each fit takes exactly
  its own ``epochs * ceil(n_train / batch)`` steps. With F = 1 this is `fit_anchor` on the same split.

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

  Raises:
    ValueError: bad shapes, overlapping masks, a fit with < 2 training or 0 validation rows (with
      ``val_mask``), non-finite embeddings or labels on used rows, or bad weights.
  """
  x, y, tm, vm, w = _check_many(embeddings, labels, train_mask, sample_weights, val_mask)
  return _fit_core(x, y, tm, vm, w, config).pred


def _check_many(embeddings: np.ndarray, labels: np.ndarray, train_mask: np.ndarray,
                sample_weights: np.ndarray | None, val_mask: np.ndarray | None) -> tuple[np.ndarray, ...]:
  """`fit_anchor_many`'s input checks.

  Returns:
    ``(x [P, D] float32, y [F, P] float64, train [F, P] bool, val [F, P] bool, w [F, P] float64)``.

  Raises:
    ValueError: naming the offending argument, fit and prompt.
  """
  x = np.asarray(embeddings, np.float32)
  y = np.asarray(labels, np.float64)
  tm = np.asarray(train_mask, bool)
  if x.ndim != 2:
    raise ValueError(f"embeddings must be [P, D], got shape {x.shape}")
  p = x.shape[0]
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
  return x, y, tm, vm, w


@dataclasses.dataclass(frozen=True)
class _Fits:
  """F fits of E epochs each, as `_fit_core` returns them."""

  graphdef: nnx.GraphDef  # of the `AnchorMLP`
  params: nnx.State  # [F, ...] parameters of each fit's kept (best) epoch
  stats: nnx.State  # [F, ...] each fit's standardisers
  pred: np.ndarray  # [F, P] float64 predictions of the kept parameters on all prompts
  train_mse: np.ndarray  # [F, E] float64 MSE on the training rows after each epoch
  val_mse: np.ndarray  # [F, E] float64 MSE on the validation rows (NaN for a fit without any)
  val_r2: np.ndarray  # [F, E] float64 1 - val_mse / var(validation labels) (NaN when that var is 0)
  best_epoch: np.ndarray  # [F] int, 0-based

  def mlp(self, i: int) -> AnchorMLP:
    """Fit ``i``'s kept `AnchorMLP`."""
    take = lambda s: jax.tree.map(lambda a: a[i], s)
    return nnx.merge(self.graphdef, take(self.params), take(self.stats))


def _fit_core(x: np.ndarray, y: np.ndarray, tm: np.ndarray, vm: np.ndarray, w: np.ndarray,
              config: AnchorFitConfig) -> _Fits:
  """The eq. (9) fit shared by `fit_anchor` and `fit_anchor_many`: F fits at once on validated inputs.

  Args:
    x: ``[P, D]`` float32 embeddings, finite.
    y: ``[F, P]`` float64 labels, finite on each fit's training and validation rows (others unused).
    tm: ``[F, P]`` bool training rows, at least 2 per fit.
    vm: ``[F, P]`` bool validation rows, disjoint from ``tm``; a fit without any keeps its last epoch.
    w: ``[F, P]`` float64 weights, finite, >= 0 with a positive sum on each fit's training rows.
    config: `AnchorFitConfig` (``val_fraction`` unused).

  Returns:
    `_Fits`.
  """
  f, p = y.shape
  y = np.where(tm | vm, y, 0.0)
  w = np.where(tm, w, 0.0)
  w = w * (tm.sum(1) / w.sum(1))[:, None]  # mean 1 on each fit's training rows
  mlp = AnchorMLP(x.shape[1], config.hidden_sizes, config.activation, rngs=nnx.Rngs(config.seed))
  # The standardisers carry a leading fit axis ([F, D] and [F]); vmap maps them with the parameters.
  for name, value in zip(("x_mean", "x_std", "y_mean", "y_std"), _standardizers(x, y, tm)):
    getattr(mlp, name).value = jnp.asarray(value, jnp.float32)
  graphdef, params0, stats = nnx.split(mlp, nnx.Param, ...)
  params = jax.tree.map(lambda a: jnp.broadcast_to(a, (f,) + a.shape), params0)  # [F, ...] shared init
  f32 = lambda a: jnp.asarray(a, jnp.float32)
  best, pred, train_mse, val_mse, best_epoch = _train(
      params, stats, jnp.asarray(x), jnp.asarray(_minibatch_order(tm, config), jnp.int32), f32(y), f32(w),
      f32(tm), f32(vm), graphdef=graphdef, learning_rate=config.learning_rate, huber_delta=config.huber_delta)
  val_mse = np.where(vm.any(1)[:, None], np.asarray(val_mse, np.float64).T, np.nan)  # [F, E]
  n_val = np.maximum(vm.sum(1), 1)
  y_val_mean = (vm * y).sum(1) / n_val
  sst = ((vm * (y - y_val_mean[:, None]) ** 2).sum(1) / n_val)[:, None]  # [F, 1] population variance
  val_r2 = 1.0 - np.divide(val_mse, sst, out=np.full_like(val_mse, np.nan), where=sst > 0)
  return _Fits(graphdef=graphdef, params=best, stats=stats, pred=np.asarray(pred, np.float64),
               train_mse=np.asarray(train_mse, np.float64).T, val_mse=val_mse, val_r2=val_r2,
               best_epoch=np.asarray(best_epoch, np.int64))


def _standardizers(x: np.ndarray, y: np.ndarray, tm: np.ndarray) -> tuple[np.ndarray, ...]:
  """Per-fit statistics on the training rows, as `AnchorMLP.set_standardization` (population std, floor 1e-6).

  Args:
    x: ``[P, D]`` embeddings. y: ``[F, P]`` labels, finite. tm: ``[F, P]`` bool training rows.

  Returns:
    float64 ``x_mean [F, D]``, ``x_std [F, D]``, ``y_mean [F]``, ``y_std [F]``.
  """
  n_train = tm.sum(1)  # [F]
  m = tm.astype(np.float64)
  x_mean = (m @ x) / n_train[:, None]
  x_var = (m @ (x.astype(np.float64) ** 2)) / n_train[:, None] - x_mean ** 2
  x_std = np.maximum(np.sqrt(np.maximum(x_var, 0.0)), 1e-6)
  y_mean = np.where(tm, y, 0.0).sum(1) / n_train
  y_std = np.maximum(np.sqrt(np.sum(np.where(tm, (y - y_mean[:, None]) ** 2, 0.0), 1) / n_train), 1e-6)
  return x_mean, x_std, y_mean, y_std


def _minibatch_order(tm: np.ndarray, config: AnchorFitConfig) -> np.ndarray:
  """Each fit's minibatches of every epoch: its training rows in a fresh random order (seeded by ``config.seed``).

  Args:
    tm: ``[F, P]`` bool training rows.
    config: ``epochs``, ``batch_size`` and ``seed``.

  Returns:
    ``[E, S, F, W]`` int prompt indices, -1 for padding, with ``W = max_f min(batch_size, n_train_f)``
    and ``S = max_f ceil(n_train_f / W_f)``; fit f's batches hold ``min(batch_size, n_train_f)`` rows.
  """
  f, p = tm.shape
  n_train = tm.sum(1)  # [F]
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
  return np.where(ok[None], gathered, -1)  # [E, S, F, W]


@functools.partial(jax.jit, static_argnames=("graphdef", "learning_rate", "huber_delta"))
def _train(params, stats, xs, order, ys, ws, tmask, vmask, *, graphdef, learning_rate, huber_delta):
  """Trains F fits for E epochs (Adam, vmapped over fits) and keeps each fit's best epoch.

  Args:
    params: ``[F, ...]`` initial `AnchorMLP` parameters. stats: ``[F, ...]`` its standardisers.
    xs: ``[P, D]`` embeddings. order: ``[E, S, F, W]`` minibatch prompt indices, -1 for padding.
    ys, ws, tmask, vmask: ``[F, P]`` float32 labels, weights (0 off the training rows), training and
      validation masks.
    graphdef, learning_rate, huber_delta: static: the model graph, Adam's step size, the loss.

  Returns:
    ``(params [F, ...], pred [F, P], train_mse [E, F], val_mse [E, F], best_epoch [F] int32)``: the kept
    parameters (lowest validation MSE, first on ties; the last epoch for a fit without validation rows),
    their predictions on all prompts, and the per-epoch MSEs.
  """
  tx = optax.adam(learning_rate)
  has_val = jnp.any(vmask > 0, -1)  # [F]

  def predict(prm, st):  # -> [P]
    return nnx.merge(graphdef, prm, st)(xs)

  def fit_step(prm, opt, st, idx, yf, wf):  # one fit, one minibatch idx: [W]
    valid = idx >= 0
    safe = jnp.maximum(idx, 0)

    def loss_fn(prm):
      model = nnx.merge(graphdef, prm, st)
      z = (yf[safe] - model.y_mean.value) / model.y_std.value  # labels in standardised units
      wb = wf[safe] * valid
      loss = residual_loss(model.normalized(xs[safe]) - z, huber_delta)  # [W]
      return jnp.sum(wb * loss) / jnp.maximum(jnp.sum(wb), 1e-12)

    updates, new_opt = tx.update(jax.grad(loss_fn)(prm), opt, prm)
    live = jnp.any(valid)  # an all-padding step (a fit with fewer minibatches) changes nothing
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(live, a, b), new, old)
    return keep(optax.apply_updates(prm, updates), prm), keep(new_opt, opt)

  def epoch(carry, inputs):  # order_e: [S, F, W]
    prm, opt, best_prm, best_mse, best_e = carry
    order_e, e = inputs
    (prm, opt), _ = jax.lax.scan(lambda c, idx: (jax.vmap(fit_step)(*c, stats, idx, ys, ws), None),
                                 (prm, opt), order_e)
    sq = (jax.vmap(predict)(prm, stats) - ys) ** 2  # [F, P]
    train_mse = jnp.sum(tmask * sq, -1) / jnp.sum(tmask, -1)  # [F]
    val_mse = jnp.sum(vmask * sq, -1) / jnp.maximum(jnp.sum(vmask, -1), 1.0)  # [F], unweighted
    better = jnp.where(has_val, val_mse < best_mse, True)  # without validation rows: keep the last epoch
    pick = lambda a, b: jnp.where(better.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)
    carry = (prm, opt, jax.tree.map(pick, prm, best_prm), jnp.where(better, val_mse, best_mse),
             jnp.where(better, e, best_e))
    return carry, (train_mse, val_mse)

  f = ys.shape[0]
  init = (params, jax.vmap(tx.init)(params), params, jnp.full((f,), jnp.inf, jnp.float32),
          jnp.zeros((f,), jnp.int32))
  epochs = jnp.arange(order.shape[0], dtype=jnp.int32)
  (_, _, best, _, best_epoch), (train_mse, val_mse) = jax.lax.scan(epoch, init, (order, epochs))
  return best, jax.vmap(predict)(best, stats), train_mse, val_mse, best_epoch
