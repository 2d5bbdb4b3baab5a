"""KL between two distributions restricted to an enumerated set (the correct answers of a prompt).

For a task whose correct set C(q) can be enumerated (the sum task), a model's preference among its
correct answers is p|C = p(o) / p(C) on C. `conditional_kl` compares two such preferences:
KL(pi|C || pi~|C) (how far the policy's choice among correct answers is from the target's; with a
binary reward pi~|C = pi_ref|C) and KL(pi|C || p_T|C) (how close it is to the proposal's, which a
replay of the proposal's correct answers may pull it towards, App. C.5).
"""
from __future__ import annotations

import numpy as np


def _log_normalize(logp: np.ndarray) -> np.ndarray:
  m = logp.max()
  return logp - (m + np.log(np.exp(logp - m).sum()))


def conditional_kl(logp_p: np.ndarray, logp_q: np.ndarray) -> float:
  """KL(p|C || q|C) = sum_{o in C} p|C(o) (log p|C(o) - log q|C(o)).

  Args:
    logp_p, logp_q: ``[C]`` log-probabilities (trajectory log-probs, unnormalised on C) of the same
      C responses under p and q; entries of p may be -inf (probability 0 on C).

  Returns:
    The KL in nats (>= 0; inf when q gives 0 to a response p does not).
  """
  lp, lq = np.asarray(logp_p, np.float64), np.asarray(logp_q, np.float64)
  if lp.ndim != 1 or lp.shape != lq.shape or lp.size == 0:
    raise ValueError(f"conditional_kl needs two [C] arrays of one shape, C >= 1, got shapes "
                     f"{lp.shape} and {lq.shape}")
  if np.isnan(lp).any() or np.isnan(lq).any() or not np.isfinite(lp.max()):
    raise ValueError("conditional_kl: log-probs must not be NaN and p must give the set mass")
  p_log, q_log = _log_normalize(lp), _log_normalize(lq)
  p = np.exp(p_log)
  on = p > 0
  if np.isneginf(q_log[on]).any():
    return float("inf")
  return float(np.sum(p[on] * (p_log[on] - q_log[on])))
