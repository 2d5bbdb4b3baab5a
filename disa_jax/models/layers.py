"""Pure functions of the decoder block: RMSNorm, RoPE and projections (attention: `attention`).

They follow the numerics of the Hugging Face implementations (normalisation and softmax in float32,
rotate-half RoPE with float32 angles) so that float32 logits agree to ~1e-5.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from disa_jax.models.config import RopeScaling

def _rms_norm_value(x: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
  """(`rms_norm`'s value, the `[..., 1]` float32 scale r = 1 / sqrt(mean(x^2) + eps))."""
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * (x32 * r).astype(x.dtype), r


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, computed in float32, scaled by `weight`.

  The gradient is written out (`_rms_norm_bwd`): one float32 pass over the rows for x and one
  reduction for the weight, where autodiff of the value chains the backward of the square, mean,
  rsqrt and both products as separate fusions.

  Args:
    x: `[..., D]` activations.
    weight: `[D]` scale.
    eps: added to the mean square.

  Returns:
    `[..., D]` in x's dtype (HF: normalise in float32, cast back, then multiply by the weight).
  """
  return _rms_norm_value(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
  y, r = _rms_norm_value(x, weight, eps)
  return y, (x, weight, r)


def _rms_norm_bwd(eps, res, dy):
  """With n = x r and g = dy w: dx = r (g - n mean(g n)), dw = sum over rows of dy n (float32)."""
  del eps
  x, weight, r = res
  n = x.astype(jnp.float32) * r
  dy32 = dy.astype(jnp.float32)
  g = dy32 * weight.astype(jnp.float32)
  dx = r * (g - n * jnp.mean(g * n, axis=-1, keepdims=True))
  dw = jnp.sum(dy32 * n, axis=tuple(range(x.ndim - 1)))
  return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """Inverse RoPE frequencies `[head_dim // 2]` float32, with HF's 'linear'/'llama3' scaling."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
  inv_freq = (1.0 / (theta ** exponents.astype(np.float64))).astype(np.float32)
  if scaling is None:
    return inv_freq
  if scaling.rope_type == "linear":
    return (inv_freq / scaling.factor).astype(np.float32)
  # llama3: long wavelengths divided by `factor`, short ones kept, a smooth blend in between.
  old_len = scaling.original_max_position_embeddings
  low_wavelen = old_len / scaling.low_freq_factor
  high_wavelen = old_len / scaling.high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old_len / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables for rotate-half RoPE.

  Args:
    positions: `[B, T]` int positions.
    inv_freq: `[H/2]` inverse frequencies.

  Returns:
    (cos, sin), each `[B, T, H]` float32 (the `H/2` angles repeated twice, as HF does).
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
  angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, H/2] -> [B, T, H]
  return jnp.cos(angles), jnp.sin(angles)


def _rotate_half(x: jax.Array, sign: float) -> jax.Array:
  """`[-x2, x1]` (sign 1) or its transpose `[x2, -x1]` (sign -1), halves of the last axis."""
  half = x.shape[-1] // 2
  return jnp.concatenate([-sign * x[..., half:], sign * x[..., :half]], axis=-1)


def _rope_tables(cos: jax.Array, sin: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """`[B, T, H]` float32 tables as `[B, T, 1, H]` in `dtype` (cast first, like HF)."""
  return cos[:, :, None, :].astype(dtype), sin[:, :, None, :].astype(dtype)


@jax.custom_vjp
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE.

  The map is linear in x, y = x cos + R(x) sin, so its gradient is the transposed rotation,
  dx = dy cos + R^T(dy sin): one elementwise pass (`_apply_rope_bwd`), where autodiff of the
  concatenate gives pads and adds. The tables get no gradient (they come from integer positions).

  Args:
    x: `[B, T, N, H]` queries or keys.
    cos, sin: `[B, T, H]` float32 tables.

  Returns:
    `[B, T, N, H]` in x's dtype (tables are cast to x's dtype first, like HF).
  """
  c, s = _rope_tables(cos, sin, x.dtype)
  return x * c + _rotate_half(x, 1.0) * s


def _apply_rope_fwd(x, cos, sin):
  return apply_rope(x, cos, sin), (cos, sin)


def _apply_rope_bwd(res, dy):
  c, s = _rope_tables(*res, dy.dtype)
  return dy * c + _rotate_half(dy * s, -1.0), None, None


apply_rope.defvjp(_apply_rope_fwd, _apply_rope_bwd)


def segment_positions(segment_ids: jax.Array) -> jax.Array:
  """Positions that restart at 0 in each segment of a packed row.

  Args:
    segment_ids: `[B, T]` int; a new segment starts wherever the id differs from the previous
      token's (padding, id 0, counts as a segment of its own).

  Returns:
    `[B, T]` int32: the index of each token within its segment.
  """
  seg = segment_ids.astype(jnp.int32)
  idx = jnp.broadcast_to(jnp.arange(seg.shape[1], dtype=jnp.int32), seg.shape)
  starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def _flat(x: jax.Array, w: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
  """x `[..., C1..Cn]` and w `[C1..Cn, O...]` as the matrices `[M, C]` and `[C, O]`."""
  c = math.prod(w.shape[:n])
  return x.reshape(-1, c), w.reshape(c, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense(x: jax.Array, w: jax.Array, n: int = 1, out_dtype: Any = None) -> jax.Array:
  """A projection: x's last ``n`` axes contracted with w's first ``n``.

  The value is ``jnp.tensordot(x, w, n)``; the gradient is written out as two row-major matmuls,
  dx = dy w^T and dw = x^T dy. For the weight gradient XLA:CPU otherwise emits a dot contracted on
  its left operand's leading axis after transposing the larger `[M, O]` cotangent; here x is
  transposed once instead. On a 2-core CPU the SwiGLU block's forward + backward ran 1.3-1.9x
  faster (a one-off measurement); `benchmarks/bench_models_speed.py` times the train step with
  autodiff projections ("before") against this. Other backends get the same two dots.

  Args:
    x: `[..., C1..Cn]` activations.
    w: `[C1..Cn, O...]` kernel, in x's dtype.
    n: how many axes are contracted.
    out_dtype: the result's dtype (the matmul accumulates in it; None: x's dtype). The cotangents
      come back in x's and w's dtypes.

  Returns:
    `[..., O...]`.
  """
  a, b = _flat(x, w, n)
  y = jnp.matmul(a, b, preferred_element_type=out_dtype)
  return y.reshape(x.shape[:x.ndim - n] + w.shape[n:])


def _dense_fwd(x, w, n, out_dtype):
  return dense(x, w, n, out_dtype), (x, w)


def _dense_bwd(n, out_dtype, res, dy):
  del out_dtype
  x, w = res
  a, b = _flat(x, w, n)
  g = dy.reshape(a.shape[0], b.shape[1])  # [M, O]
  dx = jnp.matmul(g, b.T.astype(g.dtype)).astype(x.dtype)
  dw = jnp.matmul(a.T.astype(g.dtype), g).astype(w.dtype)
  return dx.reshape(x.shape), dw.reshape(w.shape)


dense.defvjp(_dense_fwd, _dense_bwd)
