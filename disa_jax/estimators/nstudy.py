"""The offline-budget study of App. D.3: how log Z_IS behaves as the number of samples M grows.

From a pool of samples per prompt (the paper uses 32), M in {2, 4, 8, 16} samples are drawn without
replacement many times; for each prompt we record

- the variance of log Z_M across repeats, and
- the relative bias |Z_M - Z_pool| / Z_pool, averaged over repeats (linear scale),

and a representative prompt subset is chosen by k-means on prompt embeddings (SSE-vs-k elbow), then
sampled stratified by cluster.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from disa_jax.estimators.importance import log_z_is

Array = jax.Array


@functools.partial(jax.jit, static_argnames=("m", "repeats"))
def subsample_log_z(key: Array, log_w: Array, mask: Array, *, m: int, repeats: int) -> Array:
  """log Z_M from ``repeats`` subsamples of size M drawn without replacement from each prompt's pool.

  Args:
    key: PRNG key.
    log_w: ``[P, Npool]`` log importance weights of the pool.
    mask: ``[P, Npool]`` bool validity of the pool entries.
    m: subsample size M.
    repeats: R, the number of independent subsamples per prompt.

  Returns:
    ``[R, P]`` float32 log Z_M; NaN for prompts with fewer than M valid pool samples.
  """
  p, npool = log_w.shape
  if m > npool:
    raise ValueError(f"subsample size m={m} exceeds the pool size {npool}")
  u = jax.random.uniform(key, (repeats, p, npool))  # [R, P, Npool]
  u = jnp.where(mask[None], u, 2.0)  # invalid entries sort last
  order = jnp.argsort(u, axis=-1)[..., :m]  # [R, P, M] a uniform random M-subset of the valid entries
  sub = jnp.take_along_axis(jnp.broadcast_to(log_w[None], u.shape), order, axis=-1)  # [R, P, M]
  out = log_z_is(sub.reshape(repeats * p, m)).reshape(repeats, p)  # flatten (R, P) rows for the estimator
  enough = mask.sum(-1) >= m  # [P]
  return jnp.where(enough[None], out, jnp.nan)


@dataclasses.dataclass
class NStudyResult:
  """Per-M, per-prompt results of `n_study` (all arrays ``[len(ms), P]``)."""

  ms: tuple[int, ...]
  log_z_pool: np.ndarray  # [P] the pool estimate used as pseudo ground truth
  variance: np.ndarray  # [len(ms), P] Var over repeats of log Z_M
  relative_bias: np.ndarray  # [len(ms), P] mean over repeats of |Z_M - Z_ref| / Z_ref
  log_abs_error: np.ndarray  # [len(ms), P] mean over repeats of |log Z_M - log Z_ref|
  mean_log_z: np.ndarray  # [len(ms), P] mean over repeats of log Z_M

  def summary(self) -> list[dict[str, float]]:
    """One row per M: mean and median of the per-prompt variance and relative bias (NaN-aware)."""
    rows = []
    for i, m in enumerate(self.ms):
      rows.append({
          "M": m,
          "variance_mean": float(np.nanmean(self.variance[i])),
          "variance_median": float(np.nanmedian(self.variance[i])),
          "relative_bias_mean": float(np.nanmean(self.relative_bias[i])),
          "relative_bias_median": float(np.nanmedian(self.relative_bias[i])),
          "log_abs_error_mean": float(np.nanmean(self.log_abs_error[i])),
      })
    return rows


def n_study(key: Array,
            log_w: Array,
            mask: Array | None = None,
            *,
            ms: Sequence[int] = (2, 4, 8, 16),
            repeats: int = 64,
            log_z_ref: Array | None = None) -> NStudyResult:
  """Runs the App. D.3 subsampling study.

  Args:
    key: PRNG key.
    log_w: ``[P, Npool]`` pool log-weights.
    mask: optional ``[P, Npool]`` validity mask.
    ms: subsample sizes M, each <= Npool.
    repeats: subsamples per prompt and M.
    log_z_ref: optional ``[P]`` reference log Z (e.g. the exact value on a synthetic task); defaults
      to the pool estimate log Z_pool, as in the paper.

  Returns:
    An `NStudyResult`.
  """
  log_w = jnp.asarray(log_w, jnp.float32)
  mask = jnp.ones(log_w.shape, bool) if mask is None else jnp.asarray(mask, bool)
  if repeats < 2:
    raise ValueError(f"repeats must be >= 2 to estimate a variance, got {repeats}")
  pool = log_z_is(log_w, mask)
  ref = pool if log_z_ref is None else jnp.asarray(log_z_ref, jnp.float32)
  var, rel, lae, mean = [], [], [], []
  for i, m in enumerate(ms):
    lz = subsample_log_z(jax.random.fold_in(key, i), log_w, mask, m=int(m), repeats=repeats)  # [R, P]
    var.append(jnp.var(lz, axis=0, ddof=1))
    rel.append(jnp.mean(jnp.abs(jnp.expm1(lz - ref[None])), axis=0))  # |Z_M/Z_ref - 1|
    lae.append(jnp.mean(jnp.abs(lz - ref[None]), axis=0))
    mean.append(jnp.mean(lz, axis=0))
  as_np = lambda xs: np.asarray(jnp.stack(xs))
  return NStudyResult(tuple(int(m) for m in ms), np.asarray(pool), as_np(var), as_np(rel), as_np(lae),
                      as_np(mean))


# ------------------------------------------------------------------------------------------------
# Stratified prompt subset: k-means on embeddings with an SSE elbow.
# ------------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("k", "iters"))
def kmeans(key: Array, x: Array, *, k: int, iters: int = 50) -> tuple[Array, Array, Array]:
  """Lloyd's k-means with k-means++ seeding.

  Args:
    key: PRNG key.
    x: ``[P, D]`` points (prompt embeddings).
    k: number of clusters (<= P).
    iters: Lloyd iterations.

  Returns:
    (centroids ``[k, D]``, labels ``[P]`` int32, SSE scalar).
  """
  x = jnp.asarray(x, jnp.float32)
  p = x.shape[0]

  def sqdist(c):  # [P, k]
    return jnp.sum(x * x, -1)[:, None] - 2.0 * jnp.einsum("pd,kd->pk", x, c) + jnp.sum(c * c, -1)[None, :]

  # k-means++ seeding: each next centre is drawn with probability proportional to D(x)^2.
  keys = jax.random.split(key, k)
  first = jax.random.randint(keys[0], (), 0, p)
  cents = jnp.zeros((k, x.shape[1]), jnp.float32).at[0].set(x[first])

  def seed_step(j, cents):
    d2 = jnp.min(jnp.where(jnp.arange(k)[None, :] < j, sqdist(cents), jnp.inf), axis=1)
    d2 = jnp.maximum(d2, 0.0)
    probs = jnp.where(d2.sum() > 0, d2 / jnp.maximum(d2.sum(), 1e-30), jnp.full((p,), 1.0 / p))
    idx = jax.random.choice(keys[j], p, p=probs)
    return cents.at[j].set(x[idx])

  cents = jax.lax.fori_loop(1, k, seed_step, cents)

  def lloyd(_, cents):
    labels = jnp.argmin(sqdist(cents), axis=1)
    onehot = jax.nn.one_hot(labels, k, dtype=jnp.float32)  # [P, k]
    counts = onehot.sum(0)  # [k]
    sums = jnp.einsum("pk,pd->kd", onehot, x)
    return jnp.where(counts[:, None] > 0, sums / jnp.maximum(counts, 1)[:, None], cents)  # keep empty ones

  cents = jax.lax.fori_loop(0, iters, lloyd, cents)
  d = jnp.maximum(sqdist(cents), 0.0)
  labels = jnp.argmin(d, axis=1).astype(jnp.int32)
  sse = jnp.sum(jnp.min(d, axis=1))
  return cents, labels, sse


def sse_curve(key: Array, x: Array, ks: Sequence[int], iters: int = 50, restarts: int = 3) -> np.ndarray:
  """SSE of k-means for each k (best of ``restarts``), for the elbow plot of App. D.3.

  Returns:
    ``[len(ks)]`` float SSE values.
  """
  out = []
  for i, k in enumerate(ks):
    if not 1 <= k <= x.shape[0]:
      raise ValueError(f"k must be in [1, P={x.shape[0]}], got {k}")
    best = min(float(kmeans(jax.random.fold_in(key, 1000 * i + r), x, k=int(k), iters=iters)[2])
               for r in range(restarts))
    out.append(best)
  return np.asarray(out)


def elbow_k(ks: Sequence[int], sse: Sequence[float]) -> int:
  """The elbow of an SSE-vs-k curve: the k farthest below the chord from the first to the last point.

  Both axes are rescaled to [0, 1] first, so the choice does not depend on units.
  """
  ks_a = np.asarray(ks, float)
  s = np.asarray(sse, float)
  if len(ks_a) < 3:
    raise ValueError(f"need at least 3 values of k for an elbow, got {list(ks)}")
  xn = (ks_a - ks_a[0]) / (ks_a[-1] - ks_a[0])
  yn = (s - s.min()) / max(s.max() - s.min(), 1e-12)
  chord = yn[0] + (yn[-1] - yn[0]) * xn
  return int(ks_a[int(np.argmax(chord - yn))])


def stratified_subset(key: Array, labels: Array, n: int) -> np.ndarray:
  """Draws about n prompt indices, allocated to clusters in proportion to their sizes.

  Every non-empty cluster gets at least one index (largest-remainder allocation otherwise).

  Args:
    key: PRNG key.
    labels: ``[P]`` cluster label per prompt.
    n: target subset size, 1 <= n <= P.

  Returns:
    sorted int64 indices into the P prompts, exactly n of them (or P if n >= P).
  """
  labels = np.asarray(labels)
  p = labels.shape[0]
  if n >= p:
    return np.arange(p)
  if n < 1:
    raise ValueError(f"subset size n must be >= 1, got {n}")
  clusters, counts = np.unique(labels, return_counts=True)
  quota = counts / p * n
  alloc = np.maximum(np.floor(quota).astype(int), 1)
  alloc = np.minimum(alloc, counts)
  rem = quota - np.floor(quota)
  while alloc.sum() < n:  # largest remainder first, within cluster capacity
    cand = np.where(alloc < counts, rem, -np.inf)
    j = int(np.argmax(cand))
    alloc[j] += 1
    rem[j] = -np.inf if alloc[j] >= counts[j] else rem[j] - 1
  while alloc.sum() > n:  # too many clusters for n: trim the largest allocations
    alloc[int(np.argmax(alloc))] -= 1
  raw = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  rng = np.random.default_rng(np.asarray(raw).ravel().tolist())
  chosen = [rng.choice(np.flatnonzero(labels == c), size=a, replace=False) for c, a in zip(clusters, alloc) if a]
  return np.sort(np.concatenate(chosen))
