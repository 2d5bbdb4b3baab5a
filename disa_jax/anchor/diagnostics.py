"""Stage 2 diagnostics tied to the paper's analysis of anchor error.

- `sigma_g`: RMS(g(q) - log Z(q)), the anchor error of Prop. 4 (against an exact or reference log Z).
- `anchor_error_envelope`: Prop. 4's Cauchy-Schwarz bound sigma_g^2 + 2 sigma_g sqrt(L_TB(theta; Z)) on
  |L_DISA(theta) - L_TB(theta; Z)|.
- `inverse_variance_weights`: per-prompt weights 1 / max(CV^2 / N, floor) for weighted least squares
  on log Z_IS labels (the delta-method variance of log Z_IS is about CV^2(w) / N).
"""
from __future__ import annotations

import numpy as np


def sigma_g(pred: np.ndarray, log_z: np.ndarray) -> float:
  """RMS anchor error sqrt(mean_q (g(q) - log Z(q))^2) over ``[P]`` arrays (Prop. 4's sigma_g)."""
  pred, log_z = np.asarray(pred, np.float64), np.asarray(log_z, np.float64)
  if pred.shape != log_z.shape:
    raise ValueError(f"pred and log_z differ in shape: {pred.shape} vs {log_z.shape}")
  return float(np.sqrt(np.mean((pred - log_z) ** 2)))


def anchor_error_envelope(sigma: float, tb_loss_exact: float) -> float:
  """Prop. 4: |L_DISA - L_TB(.; Z)| <= sigma_g^2 + 2 sigma_g sqrt(L_TB(.; Z))."""
  if sigma < 0 or tb_loss_exact < 0:
    raise ValueError(f"sigma_g and the TB loss must be >= 0, got {sigma}, {tb_loss_exact}")
  return float(sigma ** 2 + 2.0 * sigma * np.sqrt(tb_loss_exact))


def inverse_variance_weights(cv2: np.ndarray, n_valid: np.ndarray, floor: float = 1e-3) -> np.ndarray:
  """``[P]`` weights 1 / max(CV^2 / N, floor), normalised to mean 1 (NaN CV^2 counts as the floor).

  Args:
    cv2: ``[P]`` sample CV^2 of each prompt's weights.
    n_valid: ``[P]`` valid samples per prompt.
    floor: lower bound on the variance estimate (a prompt whose sample CV^2 is 0 by chance, e.g.
      all-equal weights, must not get unbounded weight).
  """
  if not floor > 0:
    raise ValueError(f"floor must be > 0, got {floor}")
  var = np.where(np.isfinite(cv2), np.asarray(cv2, np.float64), 0.0) / np.maximum(np.asarray(n_valid), 1)
  w = 1.0 / np.maximum(var, floor)
  return w / w.mean()
