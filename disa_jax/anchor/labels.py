"""Stage 2 regression targets: which per-prompt label the anchor regresses, and with which weights.

The paper fits g_psi by plain least squares on the logsumexp labels log Z_IS (eq. 9). The options here
keep that as the default and add the sharper variants of issue 9, each measured against the exact log Z
by `disa_jax.pipeline.anchor_study`:

Labels (``LABEL_VARIANTS``):
  'plain'      log Z_IS, eq. (8): Jensen-biased downward by about CV^2(w) / (2N) (Prop. 1).
  'jensen'     log Z_IS + CV^2 / (2N): removes Prop. 1's second-order bias with the sample CV^2.
  'jackknife'  N L_N - (N - 1) mean_i L_{N-1}^{(-i)}: cancels the whole 1/N bias term; bias O(1/N^2).

Weightings (``WEIGHTINGS``):
  'uniform'           ordinary least squares, eq. (9).
  'inverse_variance'  weighted least squares with per-prompt weights 1 / max(CV^2 / N, floor), the
                      delta-method inverse variance of log Z_IS (`diagnostics.inverse_variance_weights`).
"""
from __future__ import annotations

import numpy as np

from disa_jax.anchor.diagnostics import inverse_variance_weights
from disa_jax.estimators.dataset import Stage1Data
from disa_jax.estimators.importance import (cv_squared, jackknife_log_z, jensen_corrected_log_z, log_z_is)

LABEL_VARIANTS = ("plain", "jensen", "jackknife")
WEIGHTINGS = ("uniform", "inverse_variance")
DEFAULT_FLOOR = 1e-3

# The `AnchorMeta.label_kind` recorded for each label variant.
LABEL_KINDS = {"plain": "log_z_is", "jensen": "jensen_corrected", "jackknife": "jackknife"}


def check_variant(variant: str, weighting: str, floor: float) -> None:
  """Raises ValueError naming the field and value if any option is unknown or out of range."""
  if variant not in LABEL_VARIANTS:
    raise ValueError(f"label variant must be one of {LABEL_VARIANTS}, got variant={variant!r}")
  if weighting not in WEIGHTINGS:
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got weighting={weighting!r}")
  if not floor > 0:
    raise ValueError(f"floor must be > 0, got floor={floor!r}")


def targets_from_log_weights(log_w: np.ndarray,
                             mask: np.ndarray,
                             variant: str = "plain",
                             weighting: str = "uniform",
                             floor: float = DEFAULT_FLOOR) -> tuple[np.ndarray, np.ndarray | None]:
  """Labels and regression weights from a ragged ``[P, N]`` matrix of log importance weights.

  Args:
    log_w: ``[P, N]`` log importance weights (w of eq. 7), -inf allowed.
    mask: ``[P, N]`` bool validity mask.
    variant: one of ``LABEL_VARIANTS``.
    weighting: one of ``WEIGHTINGS``.
    floor: lower bound on the per-prompt label variance CV^2 / N for 'inverse_variance'.

  Returns:
    (``[P]`` float64 labels, ``[P]`` float64 weights normalised to mean 1, or None for 'uniform').
    Labels are NaN for rows without a valid sample (`fit_anchor` refuses them by index).
  """
  check_variant(variant, weighting, floor)
  log_w = np.asarray(log_w, np.float32)
  mask = np.asarray(mask, bool)
  if log_w.ndim != 2 or mask.shape != log_w.shape:
    raise ValueError(f"log_w must be [P, N] and mask the same shape, got {log_w.shape} and {mask.shape}")
  n_valid = mask.sum(-1)
  cv2 = np.asarray(cv_squared(log_w, mask), np.float64)
  if variant == "plain":
    labels = np.asarray(log_z_is(log_w, mask), np.float64)
  elif variant == "jensen":
    labels = np.asarray(jensen_corrected_log_z(log_z_is(log_w, mask), cv2, n_valid), np.float64)
  else:
    labels = np.asarray(jackknife_log_z(log_w, mask), np.float64)
  weights = None if weighting == "uniform" else inverse_variance_weights(cv2, n_valid, floor)
  return labels, weights


def anchor_targets(data: Stage1Data,
                   variant: str = "plain",
                   weighting: str = "uniform",
                   floor: float = DEFAULT_FLOOR,
                   samples: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
  """The Stage 2 labels and weights of a Stage 1 dataset (log weights recomputed on its label scale).

  ``anchor_targets(data)`` with the defaults returns the stored eq. (8) labels (recomputed) and None,
  i.e. the paper's plain least squares.

  Args:
    data: a loaded `Stage1Data`.
    variant, weighting, floor: see `targets_from_log_weights`.
    samples: use only the first this many samples of each prompt (N of eq. 8; e.g. the labels at
      N = 8 of a Stage 1 pool drawn with N = 32 for the App. D.3 study); 0 = all.

  Returns:
    (``[P]`` labels, ``[P]`` weights or None).
  """
  check_variant(variant, weighting, floor)
  if samples < 0:
    raise ValueError(f"samples must be >= 0 (0 = all), got samples={samples!r}")
  n = samples or data.mask.shape[1]
  return targets_from_log_weights(data.log_weights()[:, :n], data.mask[:, :n], variant, weighting,
                                  floor)
