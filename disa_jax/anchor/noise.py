"""A controlled anchor: the exact log Z plus a fixed per-prompt offset of known RMS sigma.

Prop. 4 bounds what an anchor error eta(q) = g(q) - log Z(q) of RMS sigma_g can do to the loss; to
measure its effect on the end state as a function of sigma_g, `noisy_log_z` builds an anchor whose
error is known exactly:

    g(q) = log Z(q) + eta(q),   eta(q) = sigma * z(q) / sqrt(mean_q' z(q')^2),

with z(q) ~ N(0, 1) drawn from a generator seeded by (seed, prompt id) alone, so each prompt's
direction does not depend on the other prompts or their order, and the RMS of eta over the prompt
set is sigma exactly (the paper's sigma_g, `disa_jax.anchor.diagnostics.sigma_g`: uncentred).
"""
from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np


def _prompt_normal(seed: int, prompt_id: str) -> float:
  """One standard normal draw determined by (seed, prompt id)."""
  digest = hashlib.sha256(f"{int(seed)}\x00{prompt_id}".encode()).digest()
  return float(np.random.default_rng(int.from_bytes(digest[:8], "little")).standard_normal())


def noise_offsets(prompt_ids: Sequence[str], sigma: float, seed: int) -> np.ndarray:
  """Per-prompt offsets eta of RMS exactly ``sigma`` (see the module docstring).

  Args:
    prompt_ids: ``[P]`` distinct prompt ids.
    sigma: the RMS of the offsets, > 0.
    seed: seeds every prompt's draw (with its id).

  Returns:
    ``[P]`` float64 offsets in the order of ``prompt_ids``.
  """
  if not (np.isfinite(sigma) and sigma > 0):
    raise ValueError(f"noise sigma must be finite and > 0, got {sigma!r}")
  ids = [str(p) for p in prompt_ids]
  if not ids:
    raise ValueError("noise_offsets needs at least one prompt id, got none")
  if len(set(ids)) != len(ids):
    dup = sorted({p for p in ids if ids.count(p) > 1})
    raise ValueError(f"noise_offsets: duplicate prompt ids {dup[:10]}")
  z = np.asarray([_prompt_normal(seed, p) for p in ids])
  return sigma * z / np.sqrt(np.mean(z**2))


def noisy_log_z(log_z: Mapping[str, float], sigma: float, seed: int) -> dict[str, float]:
  """``{prompt id: log Z + eta}``: the exact table with the offsets of `noise_offsets`."""
  ids = list(log_z)
  eta = noise_offsets(ids, sigma, seed)
  return {p: float(log_z[p]) + float(e) for p, e in zip(ids, eta)}
