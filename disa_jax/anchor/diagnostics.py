"""Stage 2 diagnostics tied to the paper's analysis of anchor error.

- `sigma_g`: RMS(g(q) - log Z(q)), the anchor error of Prop. 4 (against an exact or reference log Z).
- `anchor_error_envelope`: Prop. 4's Cauchy-Schwarz bound sigma_g^2 + 2 sigma_g sqrt(L_TB(theta; Z)) on
  |L_DISA(theta) - L_TB(theta; Z)|.
- `prop4_check`: that bound as a measurement whose two sides are estimated independently (the gap on
  the anchor's training prompts, sigma_g on its held-out prompts), so it can fail.
- `inverse_variance_weights`: per-prompt weights 1 / max(CV^2 / N, floor) for weighted least squares
  on log Z_IS labels (the delta-method variance of log Z_IS is about CV^2(w) / N).
"""
from __future__ import annotations

import dataclasses

import numpy as np


def sigma_g(pred: np.ndarray, log_z: np.ndarray) -> float:
  """RMS anchor error sqrt(mean_q (g(q) - log Z(q))^2) over ``[P]`` arrays (Prop. 4's sigma_g)."""
  pred, log_z = np.asarray(pred, np.float64), np.asarray(log_z, np.float64)
  if pred.shape != log_z.shape:
    raise ValueError(f"pred and log_z differ in shape: {pred.shape} vs {log_z.shape}")
  return float(np.sqrt(np.mean((pred - log_z) ** 2)))


def generalisation(pred: np.ndarray, log_z: np.ndarray, constant: float) -> dict[str, float]:
  """The anchor against the exact log Z on a set of prompts ``[P]``: sigma_g, R^2 = 1 - SSE / SST
  (SST around these prompts' own mean: 0 = as good as the best constant for them, which no fit
  knows), and sigma of ``constant`` (the fit's mean label: the predictor a fit without features
  would give) with its ratio to sigma_g."""
  pred, log_z = np.asarray(pred, np.float64), np.asarray(log_z, np.float64)
  sst = float(np.sum((log_z - log_z.mean()) ** 2))
  sg = sigma_g(pred, log_z)
  const = sigma_g(np.full_like(log_z, constant), log_z)
  return {"prompts": int(log_z.size), "sigma_g": sg,
          "r2": 1.0 - float(np.sum((pred - log_z) ** 2)) / sst if sst > 0 else float("nan"),
          "sigma_constant": const, "sigma_g_over_constant": sg / const if const > 0 else float("nan"),
          "log_z_std": float(log_z.std()), "log_z_range": float(log_z.max() - log_z.min())}


def anchor_error_envelope(sigma: float, tb_loss_exact: float) -> float:
  """Prop. 4: |L_DISA - L_TB(.; Z)| <= sigma_g^2 + 2 sigma_g sqrt(L_TB(.; Z))."""
  if sigma < 0 or tb_loss_exact < 0:
    raise ValueError(f"sigma_g and the TB loss must be >= 0, got {sigma}, {tb_loss_exact}")
  return float(sigma ** 2 + 2.0 * sigma * np.sqrt(tb_loss_exact))


@dataclasses.dataclass(frozen=True)
class Prop4Check:
  """Prop. 4 measured at a policy (`prop4_check`).

  Attributes:
    sigma_g_train, sigma_g_heldout: RMS anchor error on the anchor's training / held-out prompts.
    loss_tb, loss_disa: L_TB(theta; Z) (exact log Z) and L_DISA (the anchor) on the training prompts.
    loss_gap: |L_DISA - L_TB| on the training prompts.
    envelope_same_sample: sigma_g_train^2 + 2 sigma_g_train sqrt(L_TB): Cauchy-Schwarz on the same
      sample moments, so it cannot be exceeded; a number, never a verdict.
    envelope: sigma_g_heldout^2 + 2 sigma_g_heldout sqrt(L_TB): the bound with sigma_g estimated on
      prompts the gap did not use (NaN without held-out prompts).
    verdict: 'holds' | 'violated' from ``loss_gap <= envelope``; None without held-out prompts (no
      independent estimate, so no check that could fail).
  """
  sigma_g_train: float
  sigma_g_heldout: float
  loss_tb: float
  loss_disa: float
  loss_gap: float
  envelope_same_sample: float
  envelope: float
  verdict: str | None


def prop4_check(eta_train: np.ndarray, r_mean_train: np.ndarray, r_sq_train: np.ndarray,
                eta_heldout: np.ndarray) -> Prop4Check:
  """Prop. 4, |L_DISA - L_TB| <= sigma_g^2 + 2 sigma_g sqrt(L_TB), with its two sides estimated
  independently: the gap on the anchor's training prompts, sigma_g on its held-out prompts.

  With eta(q) = g(q) - log Z(q) and R the on-policy TB residual with the exact log Z,
  L_TB = E_q E[R^2] and L_DISA = E_q E[(R + eta)^2] = L_TB + E_q[2 eta E[R] + eta^2].

  Args:
    eta_train: ``[P]`` anchor errors on the training prompts.
    r_mean_train, r_sq_train: ``[P]`` per prompt, the mean and mean square of the residual R.
    eta_heldout: ``[H]`` anchor errors on the held-out prompts (H = 0: no verdict).

  Returns:
    `Prop4Check`.
  """
  eta, r1, r2 = (np.asarray(x, np.float64) for x in (eta_train, r_mean_train, r_sq_train))
  if not eta.size or not eta.shape == r1.shape == r2.shape:
    raise ValueError(f"prop4_check needs equal, non-empty [P] training arrays, got shapes "
                     f"{eta.shape}, {r1.shape}, {r2.shape}")
  held = np.asarray(eta_heldout, np.float64)
  l_tb = float(r2.mean())
  l_disa = float(np.mean(r2 + 2.0 * eta * r1 + eta ** 2))
  s_train = float(np.sqrt(np.mean(eta ** 2)))
  s_held = float(np.sqrt(np.mean(held ** 2))) if held.size else float("nan")
  gap = abs(l_disa - l_tb)
  env = anchor_error_envelope(s_held, l_tb) if held.size else float("nan")
  return Prop4Check(sigma_g_train=s_train, sigma_g_heldout=s_held, loss_tb=l_tb, loss_disa=l_disa,
                    loss_gap=gap, envelope_same_sample=anchor_error_envelope(s_train, l_tb),
                    envelope=env,
                    verdict=None if not held.size else ("holds" if gap <= env else "violated"))


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
