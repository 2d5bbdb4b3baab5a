"""The sampler's KV cache holds its values' bits as unsigned ints of the same width (XLA:CPU runs a
bfloat16 scatter in float32 on a converted copy of the whole operand, while it scatters integers in
place): the conversions, shared by the XLA decode attention (`decode_attention`) and the Pallas
kernel (`decode_attention_pallas`)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def bits_dtype(dtype: Any) -> Any:
  """The cache's storage type for ``dtype`` values: float32 itself, others the unsigned int of
  their width."""
  dtype = jnp.dtype(dtype)
  return dtype if dtype == jnp.float32 else _BITS[dtype.itemsize]


def as_bits(x: jax.Array) -> jax.Array:
  """x as the cache stores it (`bits_dtype`)."""
  to = bits_dtype(x.dtype)
  return x if to == x.dtype else jax.lax.bitcast_convert_type(x, to)


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """The ``dtype`` values that ``bits`` (stored as `bits_dtype`) holds."""
  dtype = jnp.dtype(dtype)
  return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)
