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
  """The unsigned int type of ``dtype``'s width (the cache's storage type)."""
  return _BITS[jnp.dtype(dtype).itemsize]


def as_bits(x: jax.Array) -> jax.Array:
  """x's bits as unsigned ints of its width."""
  return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


def from_bits(bits: jax.Array, dtype: Any) -> jax.Array:
  """The ``dtype`` values whose bits ``bits`` holds."""
  return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype))
