"""Speed of the Stage 1 label kernel: jitted `log_z_is` vs a NumPy/SciPy logsumexp baseline.

P = 1,000,000 prompts x N = 8 samples (float32), both given the same host array, both returning a
host array (so transfer and synchronisation are timed for JAX). Repetitions alternate between the
two implementations; medians and min-max are printed with the ratio. Target: >= 2x the baseline and
under 1 s.

    python benchmarks/bench_estimators_logz.py [--prompts 1000000] [--samples 8] [--reps 15]
"""
import argparse
import statistics
import time

import jax
import numpy as np
from scipy.special import logsumexp

from disa_jax.estimators import log_z_is


def numpy_log_z_is(log_w: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """The baseline: masked logsumexp minus log N with SciPy, the way one writes it in NumPy."""
  x = np.where(mask, log_w, -np.inf)
  n = mask.sum(-1)
  with np.errstate(divide="ignore"):
    out = logsumexp(x, axis=-1) - np.log(np.maximum(n, 1))
  return np.where(n > 0, out, np.nan)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--prompts", type=int, default=1_000_000)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--reps", type=int, default=15)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  log_w = rng.normal(scale=3.0, size=(args.prompts, args.samples)).astype(np.float32)
  mask = rng.random((args.prompts, args.samples)) > 0.05  # ragged: ~5% invalid samples

  def run_jax():
    return np.asarray(log_z_is(log_w, mask))

  def run_np():
    return numpy_log_z_is(log_w, mask)

  a, b = run_jax(), run_np()  # warm-up (compiles once) and correctness
  np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  tj, tn = [], []
  for _ in range(args.reps):
    for fn, acc in ((run_jax, tj), (run_np, tn)):
      t0 = time.perf_counter()
      fn()
      acc.append(time.perf_counter() - t0)
  mj, mn = statistics.median(tj), statistics.median(tn)
  print(f"log_z_is  P={args.prompts:,} N={args.samples}  devices={jax.devices()[0].platform}")
  print(f"  jax (jit)   median {mj * 1e3:8.1f} ms  (min {min(tj) * 1e3:.1f}, max {max(tj) * 1e3:.1f})")
  print(f"  numpy/scipy median {mn * 1e3:8.1f} ms  (min {min(tn) * 1e3:.1f}, max {max(tn) * 1e3:.1f})")
  print(f"  speed-up (numpy / jax, medians): {mn / mj:.2f}x   target >= 2x and jax < 1 s: "
        f"{'MET' if mn / mj >= 2 and mj < 1 else 'NOT MET'}")


if __name__ == "__main__":
  main()
