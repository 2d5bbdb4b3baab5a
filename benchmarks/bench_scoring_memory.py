"""Peak memory of chunked vs naive teacher-forced scoring at V = 151,936 and B*T = 8,192.

Peak memory is XLA's compiled memory analysis of each jitted function (temporary buffers + outputs;
the inputs - hidden states and the output projection - are the same for both and reported apart).
It is measured for the forward pass (scoring) and for forward + backward (the Stage 3 loss).
Equality of the values is checked by running the chunked path at full size and the naive formula on
row slices small enough to fit on this machine (the naive path at full size needs ~10 GB).

Usage: python benchmarks/bench_scoring_memory.py [--hidden 1024] [--chunk 1024]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from disa_jax.scoring.logprobs import logprobs_from_hidden

V = 151_936
B, T = 8, 1024  # B*T = 8,192 tokens


def naive(hidden, kernel, ids, mask):
  logits = jnp.einsum("btd,dv->btv", hidden, kernel).astype(jnp.float32)  # [B, T, V] float32
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
  out = jnp.concatenate([jnp.zeros((ids.shape[0], 1)), picked], axis=1)
  keep = jnp.concatenate([jnp.zeros_like(mask[:, :1]), mask[:, 1:] * mask[:, :-1]], axis=1)
  return jnp.where(keep > 0, out, 0.0)


def peak_bytes(fn, *args) -> tuple[int, int]:
  """(temp + output bytes, argument bytes) from XLA's memory analysis."""
  mem = jax.jit(fn).lower(*args).compile().memory_analysis()
  return mem.temp_size_in_bytes + mem.output_size_in_bytes, mem.argument_size_in_bytes


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--chunk", type=int, default=1024)
  args = parser.parse_args()
  d = args.hidden
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(d, V)) * d ** -0.5, jnp.float32)
  ids = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
  mask = jnp.ones((B, T), jnp.int32).at[0, :100].set(0)

  def chunked(h, k, i, m):
    return logprobs_from_hidden(h, k, i, m, chunk_size=args.chunk)

  def loss_of(fn):
    return jax.grad(lambda h, k, i, m: jnp.sum(fn(h, k, i, m)), argnums=(0, 1))

  print(f"V={V}  B*T={B * T}  D={d}  chunk={args.chunk}")
  for name, c_fn, n_fn in [("forward", chunked, naive),
                           ("forward+backward", loss_of(chunked), loss_of(naive))]:
    c_peak, c_args = peak_bytes(c_fn, hidden, kernel, ids, mask)
    n_peak, _ = peak_bytes(n_fn, hidden, kernel, ids, mask)
    print(f"{name:17s} peak (temp+out): chunked {c_peak / 2**20:9.1f} MiB   naive "
          f"{n_peak / 2**20:9.1f} MiB   ratio chunked/naive = {c_peak / n_peak:.4f} "
          f"(1/{n_peak / c_peak:.1f})   [inputs {c_args / 2**20:.1f} MiB]")

  # Values: chunked at full size vs the naive formula run one batch row (1,024 tokens) at a time.
  got = np.asarray(jax.jit(chunked)(hidden, kernel, ids, mask))
  naive_j = jax.jit(naive)
  ref = np.concatenate([np.asarray(naive_j(hidden[i:i + 1], kernel, ids[i:i + 1], mask[i:i + 1]))
                        for i in range(B)], axis=0)
  print(f"max |chunked - naive| over {B * T} tokens = {np.abs(got - ref).max():.3e}")


if __name__ == "__main__":
  main()
