"""The sigma_g study: how close each Stage 2 label / weighting variant gets the anchor to the exact log Z.

Issue 9 (scope 2) asks whether sharper Stage 2 targets than the paper's plain least squares on log Z_IS
(eq. 9) lower the anchor error sigma_g = RMS(g_psi(q) - log Z(q)) that bounds the TB-loss perturbation
(Prop. 4). On a task with an exact log Z (the main job's sum task) this is measured directly:

  for each N in ``ns`` and each repeat r:
    draw N of each prompt's Stage 1 pool samples (without replacement, seeded);
    build the labels of every variant (`disa_jax.anchor.labels`) from those N samples;
    split the prompts into K folds (each prompt held out exactly once);
    fit g_psi on K - 1 folds and predict the held-out fold (all fits at once, `fit_anchor_many`; with
      ``fit.val_fraction > 0`` a share of the K - 1 folds is an inner validation split for the best
      epoch, as in the main job's Stage 2; the held-out fold is never used for fitting or selection);
    sigma_g = RMS over prompts of (held-out prediction - exact log Z);
    label RMSE = RMS over prompts of (label - exact log Z), the same labels without the regressor.

Within a repeat every variant sees the same subsample and the same folds (paired comparison). The
verdict compares each variant with plain least squares through the per-repeat paired differences.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.anchor.fit import AnchorFitConfig, fit_anchor_many
from disa_jax.anchor.labels import DEFAULT_FLOOR, LABEL_VARIANTS, WEIGHTINGS, check_variant, targets_from_log_weights
from disa_jax.estimators.dataset import Stage1Data

BASELINE = ("plain", "uniform", "squared")  # the paper's eq. (9)


def loss_name(huber_delta: float) -> str:
  """'squared' for least squares, 'huber(delta)' otherwise."""
  return "squared" if huber_delta == 0 else f"huber({huber_delta:g})"


def subsample_pool(log_w: np.ndarray, mask: np.ndarray, n: int,
                   rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
  """Draws ``n`` of each prompt's valid samples without replacement.

  Args:
    log_w: ``[P, M]`` pool log importance weights.
    mask: ``[P, M]`` bool validity mask.
    n: samples per prompt to draw (a prompt with fewer valid samples keeps all of them).
    rng: numpy generator.

  Returns:
    (``[P, n]`` log weights, ``[P, n]`` bool mask).
  """
  if n < 1:
    raise ValueError(f"n must be >= 1, got n={n}")
  keys = rng.random(log_w.shape)
  keys[~mask] = np.inf  # invalid pool entries sort last
  idx = np.argsort(keys, axis=-1)[:, :n]  # [P, n] random valid samples first
  if idx.shape[1] < n:  # the pool is narrower than n: pad with invalid columns
    idx = np.concatenate([idx, np.zeros((idx.shape[0], n - idx.shape[1]), idx.dtype)], axis=1)
    sub_mask = np.zeros(idx.shape, bool)
    sub_mask[:, :log_w.shape[1]] = np.take_along_axis(mask, idx[:, :log_w.shape[1]], axis=-1)
  else:
    sub_mask = np.take_along_axis(mask, idx, axis=-1)
  return np.take_along_axis(log_w, idx, axis=-1), sub_mask


def fold_masks(p: int, folds: int, rng: np.random.Generator) -> np.ndarray:
  """``[folds, P]`` bool held-out masks: a random partition of the P prompts into ``folds`` near-equal parts."""
  if not 2 <= folds <= p:
    raise ValueError(f"folds must be in [2, P={p}], got folds={folds}")
  assign = np.empty(p, np.int64)
  assign[rng.permutation(p)] = np.arange(p) % folds  # fold of each prompt
  return assign[None, :] == np.arange(folds)[:, None]


def _rms(x: np.ndarray, axis=None) -> np.ndarray:
  return np.sqrt(np.mean(np.square(x), axis=axis))


@dataclasses.dataclass
class _StudyFits:
  """Every regressor fit of the study (F of them, over the same P prompts), built before any is trained.

  Attributes:
    variants: the label variants, V of them.
    combos: the (variant, weighting) pairs, C of them.
    label_err: ``[len(ns), R, V, P]`` label - exact log Z of each variant (its first weighting's labels).
    const_pred: ``[len(ns), R, P]`` held-out predictions of the constant predictor.
    labels: per fit, the ``[P]`` regression targets.
    weights: per fit, the ``[P]`` regression weights (ones for uniform weighting).
    train: per fit, the ``[P]`` bool training rows.
    val: per fit, the ``[P]`` bool inner validation rows (best-epoch selection).
    test: per fit, the ``[P]`` bool held-out fold.
    meta: per fit, (N index, repeat, combo index, fold).
  """

  variants: tuple[str, ...]
  combos: list[tuple[str, str]]
  label_err: np.ndarray
  const_pred: np.ndarray
  labels: list[np.ndarray] = dataclasses.field(default_factory=list)
  weights: list[np.ndarray] = dataclasses.field(default_factory=list)
  train: list[np.ndarray] = dataclasses.field(default_factory=list)
  val: list[np.ndarray] = dataclasses.field(default_factory=list)
  test: list[np.ndarray] = dataclasses.field(default_factory=list)
  meta: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)


def _check_study_args(x: np.ndarray, exact: np.ndarray, pool: Stage1Data, ns: Sequence[int], repeats: int,
                      variants: Sequence[str], weightings: Sequence[str], floor: float,
                      huber_deltas: Sequence[float]) -> tuple[tuple[int, ...], int, tuple[float, ...]]:
  """Validates the arguments of `sigma_g_study`.

  Args:
    x: ``[P, D]`` float32 prompt embeddings.
    exact: ``[P]`` float64 exact log Z.
    pool: the Stage 1 pool.
    ns, repeats, variants, weightings, floor, huber_deltas: as in `sigma_g_study`.

  Returns:
    (``ns`` as ints, the smallest pool size over prompts, ``huber_deltas`` as floats).

  Raises:
    ValueError: naming the argument that is out of range or of the wrong shape.
  """
  p = len(pool.prompt_ids)
  if x.ndim != 2 or x.shape[0] != p:
    raise ValueError(f"embeddings must be [P={p}, D], got shape {x.shape}")
  if exact.shape != (p,) or not np.isfinite(exact).all():
    raise ValueError(f"exact_log_z must be [P={p}] and finite, got shape {exact.shape}")
  ns = tuple(int(n) for n in ns)
  width = int(pool.mask.sum(-1).min())
  if not ns or min(ns) < 1 or max(ns) > width:
    raise ValueError(f"ns must be in [1, {width}] (the smallest pool size), got ns={ns}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got repeats={repeats}")
  if not variants or not weightings:
    raise ValueError(f"variants and weightings must be non-empty, got {variants!r}, {weightings!r}")
  for v in variants:
    for w in weightings:
      check_variant(v, w, floor)
  huber_deltas = tuple(float(h) for h in huber_deltas)
  if not huber_deltas or min(huber_deltas) < 0:
    raise ValueError(f"huber_deltas must be non-empty and >= 0, got huber_deltas={huber_deltas}")
  return ns, width, huber_deltas


def _inner_val_masks(held: np.ndarray, val_fraction: float, rng: np.random.Generator) -> np.ndarray:
  """Best-epoch validation rows inside each training fold.

  Args:
    held: ``[K, P]`` bool held-out masks (`fold_masks`).
    val_fraction: share of each fold's training prompts to validate on (rounded).
    rng: numpy generator.

  Returns:
    ``[K, P]`` bool; row k is a random ``val_fraction`` share of the prompts outside fold k.
  """
  inner_val = np.zeros_like(held)
  for k in range(held.shape[0]):
    cand = np.flatnonzero(~held[k])
    inner_val[k, rng.permutation(cand)[:int(round(val_fraction * cand.size))]] = True
  return inner_val


def _add_repeat(fits: _StudyFits, i: int, r: int, sub_w: np.ndarray, sub_m: np.ndarray, held: np.ndarray,
                inner_val: np.ndarray, exact: np.ndarray, weightings: Sequence[str], floor: float) -> None:
  """Adds the fits of one (N, repeat) cell: every (variant, weighting) on every fold.

  Args:
    fits: the study's fits, extended in place (also its ``label_err`` and ``const_pred`` cells).
    i: index of N in ``ns``.
    r: the repeat.
    sub_w: ``[P, N]`` subsampled log weights.
    sub_m: ``[P, N]`` bool mask of ``sub_w``.
    held: ``[K, P]`` bool held-out folds.
    inner_val: ``[K, P]`` bool inner validation rows (`_inner_val_masks`).
    exact: ``[P]`` exact log Z.
    weightings: the regression weightings.
    floor: variance floor of the 'inverse_variance' weighting.
  """
  p = exact.shape[0]
  targets = {}
  for vi, v in enumerate(fits.variants):
    for w in weightings:
      targets[(v, w)] = targets_from_log_weights(sub_w, sub_m, v, w, floor)
    fits.label_err[i, r, vi] = targets[(v, weightings[0])][0] - exact
  plain = targets_from_log_weights(sub_w, sub_m, "plain", "uniform", floor)[0]
  for k in range(held.shape[0]):
    fits.const_pred[i, r, held[k]] = plain[~held[k]].mean()
  for ci, (v, w) in enumerate(fits.combos):
    lab, wt = targets[(v, w)]
    for k in range(held.shape[0]):
      fits.labels.append(lab)
      fits.weights.append(np.ones(p) if wt is None else wt)
      fits.train.append(~held[k] & ~inner_val[k])
      fits.val.append(inner_val[k])
      fits.test.append(held[k])
      fits.meta.append((i, r, ci, k))


def _plan_fits(log_w: np.ndarray, mask: np.ndarray, exact: np.ndarray, ns: tuple[int, ...], repeats: int,
               variants: Sequence[str], weightings: Sequence[str], folds: int, val_fraction: float,
               floor: float, rng: np.random.Generator) -> _StudyFits:
  """Draws every subsample and split of the study and builds all its fits (none is trained yet).

  Args:
    log_w: ``[P, M]`` pool log importance weights.
    mask: ``[P, M]`` bool validity mask of the pool.
    exact: ``[P]`` exact log Z.
    ns, repeats, variants, weightings, folds, floor: as in `sigma_g_study`.
    val_fraction: the fit's inner validation share.
    rng: numpy generator of the subsamples and folds (drawn in (N, repeat) order).

  Returns:
    The `_StudyFits`, in (N, repeat, combo, fold) order.
  """
  p = log_w.shape[0]
  fits = _StudyFits(variants=tuple(variants), combos=[(v, w) for v in variants for w in weightings],
                    label_err=np.zeros((len(ns), repeats, len(variants), p)),  # label - exact
                    const_pred=np.zeros((len(ns), repeats, p)))
  for i, n in enumerate(ns):
    for r in range(repeats):
      sub_w, sub_m = subsample_pool(log_w, mask, n, rng)
      held = fold_masks(p, folds, rng)  # [K, P]
      inner_val = _inner_val_masks(held, val_fraction, rng)  # [K, P]
      _add_repeat(fits, i, r, sub_w, sub_m, held, inner_val, exact, weightings, floor)
  return fits


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyRow:
  """One (label ``variant``, ``weighting``, ``loss``) of the study (``huber_delta``: 0 = least
  squares), per N: sigma_g's mean and std over repeats and each repeat's (``sigma_g``,
  ``[len(ns)][repeats]``), the raw labels' RMSE against the exact log Z (mean, std) and their mean
  signed error (nats)."""
  variant: str
  weighting: str
  loss: str
  huber_delta: float
  sigma_g_mean: tuple[float, ...]
  sigma_g_std: tuple[float, ...]
  sigma_g: tuple[tuple[float, ...], ...]
  label_rmse_mean: tuple[float, ...]
  label_rmse_std: tuple[float, ...]
  label_bias_mean: tuple[float, ...]

  @property
  def key(self) -> tuple[str, str, str]:
    return self.variant, self.weighting, self.loss


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerdictAtN:
  """A row against plain least squares at one N (`sigma_verdict`): the mean and std over repeats
  of the paired difference of sigma_g (positive: the row is better) and the verdict in words."""
  n: int
  mean_diff: float
  std_diff: float
  verdict: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class BestAtN:
  """The row ('variant/weighting/loss') with the lowest mean sigma_g at one N."""
  n: int
  row: str
  sigma_g_mean: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyVerdict:
  """`sigma_verdict`: per row ('variant/weighting/loss') its `VerdictAtN` per N, the verdicts in
  plain words, and the best row per N."""
  verdicts: Mapping[str, tuple[VerdictAtN, ...]]
  text: str
  best: tuple[BestAtN, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SigmaStudy:
  """`sigma_g_study`'s result (anchor_study.json; the report's ``anchor_study``): the ``ns``, K
  ``folds``, ``repeats``, ``seed``, variance ``floor`` and regressor ``fit`` it ran with; one
  `StudyRow` per variant x weighting x loss; per N the constant predictor's sigma_g (the mean of
  the training folds' plain labels); the exact log Z's std over prompts, the plain label's RMSE on
  the whole pool of ``pool_size`` samples (nats), the ``seconds`` it took and, once decided, its
  `StudyVerdict`."""
  ns: tuple[int, ...]
  folds: int
  repeats: int
  seed: int
  floor: float
  fit: AnchorFitConfig
  rows: tuple[StudyRow, ...]
  constant_sigma_g_mean: tuple[float, ...]
  exact_std: float
  pool_label_rmse: float
  pool_size: int
  seconds: float
  verdict: StudyVerdict | None = codec.field(default=None, omit=None)


def _study_rows(x: np.ndarray, exact: np.ndarray, fits: _StudyFits,
                config: AnchorFitConfig) -> list[StudyRow]:
  """Trains every fit under one regression loss and summarises sigma_g per (variant, weighting).

  Args:
    x: ``[P, D]`` prompt embeddings.
    exact: ``[P]`` exact log Z.
    fits: the study's fits (`_plan_fits`).
    config: the regressor's config, its ``huber_delta`` set to the loss under study.

  Returns:
    One row per (variant, weighting), as described in `sigma_g_study`.
  """
  pred = fit_anchor_many(x, np.stack(fits.labels), np.stack(fits.train),
                         config=config, sample_weights=np.stack(fits.weights),
                         val_mask=np.stack(fits.val) if config.val_fraction > 0 else None)  # [F, P]
  held_pred = np.zeros(fits.const_pred.shape[:2] + (len(fits.combos), exact.shape[0]))  # [len(ns), R, C, P]
  for row, (i, r, ci, k) in enumerate(fits.meta):
    test = fits.test[row]
    held_pred[i, r, ci, test] = pred[row, test]
  sig = _rms(held_pred - exact, axis=-1)  # [len(ns), R, C]
  rows = []
  h = config.huber_delta
  for ci, (v, w) in enumerate(fits.combos):
    vi = fits.variants.index(v)
    lr = _rms(fits.label_err[:, :, vi], axis=-1)  # [len(ns), R]
    rows.append(StudyRow(variant=v, weighting=w, loss=loss_name(h), huber_delta=h,
                         sigma_g_mean=tuple(sig[:, :, ci].mean(1).tolist()),
                         sigma_g_std=tuple(sig[:, :, ci].std(1).tolist()),
                         sigma_g=tuple(map(tuple, sig[:, :, ci].tolist())),
                         label_rmse_mean=tuple(lr.mean(1).tolist()),
                         label_rmse_std=tuple(lr.std(1).tolist()),
                         label_bias_mean=tuple(fits.label_err[:, :, vi].mean((1, 2)).tolist())))
  return rows


def sigma_g_study(embeddings: np.ndarray,
                  pool: Stage1Data,
                  exact_log_z: np.ndarray,
                  *,
                  ns: Sequence[int] = (2, 4, 8, 16),
                  variants: Sequence[str] = LABEL_VARIANTS,
                  weightings: Sequence[str] = WEIGHTINGS,
                  folds: int = 5,
                  repeats: int = 4,
                  fit: AnchorFitConfig = AnchorFitConfig(),
                  beta: float | None = None,
                  seed: int = 0,
                  floor: float = DEFAULT_FLOOR,
                  huber_deltas: Sequence[float] = (0.0,)) -> SigmaStudy:
  """Cross-validated sigma_g of every (label variant, weighting, loss) at each N, against the exact log Z.

  Args:
    embeddings: ``[P, D]`` prompt embeddings, rows in the order of ``pool.prompt_ids``.
    pool: the Stage 1 pool (``[P, M]`` i.i.d. proposal samples per prompt, M >= max(ns)).
    exact_log_z: ``[P]`` exact log Z(q), same order, at ``beta``.
    ns: samples per prompt N to study.
    variants: label variants (`LABEL_VARIANTS`).
    weightings: regression weightings (`WEIGHTINGS`).
    folds: K of the K-fold split over prompts.
    repeats: subsample + split repetitions per N.
    fit: the regressor's `AnchorFitConfig`. With ``val_fraction > 0`` each fit holds out that share of
      its training folds' prompts as a validation split and keeps its best epoch on it (as `fit_anchor`
      does in the main job); with 0 the last epoch is kept. The held-out fold is never used for either.
    beta: inverse temperature of the weights (default: the pool's).
    seed: seeds subsamples and folds (the fits use ``fit.seed``).
    floor: variance floor of the 'inverse_variance' weighting.
    huber_deltas: regression losses to compare: 0 = least squares (eq. 9), > 0 = Huber with that
      threshold (`AnchorFitConfig.huber_delta`); ``fit.huber_delta`` itself is replaced by each.

  Returns:
    `SigmaStudy` (no verdict: `sigma_verdict`).
  """
  t0 = time.time()
  x = np.asarray(embeddings, np.float32)
  exact = np.asarray(exact_log_z, np.float64)
  ns, width, huber_deltas = _check_study_args(x, exact, pool, ns, repeats, variants, weightings, floor,
                                              huber_deltas)
  log_w = pool.log_weights(beta=beta)  # [P, M] on the pool's label scale
  full_labels, _ = targets_from_log_weights(log_w, pool.mask, "plain", "uniform", floor)
  # Build every fit of the study, then train them all in one vmapped call per loss.
  fits = _plan_fits(log_w, pool.mask, exact, ns, repeats, variants, weightings, folds, fit.val_fraction, floor,
                    np.random.default_rng(seed))
  rows = []
  for h in huber_deltas:
    rows += _study_rows(x, exact, fits, dataclasses.replace(fit, huber_delta=h))
  return SigmaStudy(ns=tuple(ns), folds=folds, repeats=repeats, seed=seed, floor=floor, fit=fit,
                    rows=tuple(rows),
                    constant_sigma_g_mean=tuple(_rms(fits.const_pred - exact, axis=-1).mean(1).tolist()),
                    exact_std=float(exact.std()), pool_label_rmse=float(_rms(full_labels - exact)),
                    pool_size=width, seconds=round(time.time() - t0, 2))


def _cell(mean: float, std: float) -> str:
  return f"{mean:.3f} ± {std:.3f}"


def format_sigma_table(result: SigmaStudy) -> str:
  """Markdown: the sigma_g table (rows variant x weighting x loss, columns N; "mean ± std" over repeats), then
  the raw label RMSE vs the exact log Z (rows: label variant), then the constant-predictor line."""
  ns = result.ns
  head = "| variant | weighting | loss | " + " | ".join(f"N = {n}" for n in ns) + " |"
  sep = "|---|---|---|" + "---|" * len(ns)
  lines = [f"sigma_g = RMS(g(q) - log Z(q)) on held-out prompts ({result.folds}-fold CV, "
           f"{result.repeats} repeats, mean ± std):", "", head, sep]
  for row in result.rows:
    cells = [_cell(m, s) for m, s in zip(row.sigma_g_mean, row.sigma_g_std)]
    lines.append(f"| {row.variant} | {row.weighting} | {row.loss} | " + " | ".join(cells) + " |")
  lines += ["", "Raw label RMSE vs the exact log Z (no regressor; mean signed error in brackets):", "",
            "| label | " + " | ".join(f"N = {n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
  seen = set()
  for row in result.rows:
    if row.variant in seen:
      continue
    seen.add(row.variant)
    cells = [f"{_cell(m, s)} ({b:+.3f})" for m, s, b in
             zip(row.label_rmse_mean, row.label_rmse_std, row.label_bias_mean)]
    lines.append(f"| {row.variant} | " + " | ".join(cells) + " |")
  const = ", ".join(f"N = {n}: {c:.3f}" for n, c in zip(ns, result.constant_sigma_g_mean))
  lines += ["", f"Constant predictor (mean training label) sigma_g: {const}; std of the exact log Z over "
            f"prompts {result.exact_std:.3f}; plain label on the whole {result.pool_size}-sample pool: "
            f"RMSE {result.pool_label_rmse:.3f}."]
  return "\n".join(lines)


def sigma_verdict(result: SigmaStudy) -> StudyVerdict:
  """Per variant and N: does it beat plain least squares?

  Uses the per-repeat paired difference d_r = sigma_g(plain, uniform, squared) - sigma_g(row) (same subsample
  and folds): 'better' if mean(d) > std(d), 'worse' if mean(d) < -std(d), else 'no clear difference'.
  With one repeat std(d) = 0, so any difference counts; use several repeats.

  Returns:
    `StudyVerdict`.
  """
  rows = {r.key: r for r in result.rows}
  if BASELINE not in rows:
    raise ValueError(f"the study has no baseline row {BASELINE}; rows: {sorted(rows)}")
  base = np.asarray(rows[BASELINE].sigma_g)  # [len(ns), R]
  verdicts, text = {}, []
  for key, row in rows.items():
    if key == BASELINE:
      continue
    d = base - np.asarray(row.sigma_g)  # [len(ns), R] positive = the variant is better
    out, words = [], []
    for i, n in enumerate(result.ns):
      m, s = float(d[i].mean()), float(d[i].std())
      v = "better" if m > s else ("worse" if m < -s else "no clear difference")
      out.append(VerdictAtN(n=n, mean_diff=m, std_diff=s, verdict=v))
      words.append(f"N = {n}: {v} ({-m:+.3f} ± {s:.3f})")
    name = "/".join(key)
    verdicts[name] = tuple(out)
    text.append(f"- {name} vs plain/uniform/squared (change in sigma_g, paired over repeats): " + "; ".join(words))
  best = []
  for i, n in enumerate(result.ns):
    k = min(rows, key=lambda kk: rows[kk].sigma_g_mean[i])
    best.append(BestAtN(n=n, row="/".join(k), sigma_g_mean=rows[k].sigma_g_mean[i]))
  wins = [name for name, out in verdicts.items() if any(o.verdict == "better" for o in out)]
  text.append("- No variant beats plain least squares by more than the repeat spread at any N."
              if not wins else f"- Variants that beat plain least squares at some N: {', '.join(wins)}.")
  return StudyVerdict(verdicts=verdicts, text="\n".join(text), best=tuple(best))
