"""Shared inputs of the attention implementation tests: grouped-query heads (4 query heads per
key/value head, as Qwen3's 32 / 8), packed rows with unequal segments and padding, and
shared-prompt (branch) rows; the dense reference and its values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from disa_jax.models import attention

B, T, N, K, H = 2, 24, 8, 2, 8
REL_TOL = 1e-6  # float32: implementation vs reference, relative to the largest reference entry


def qkv(seed=0, t=T, dtype=jnp.float32, n=N, kv=K, h=H):
  """q `[B, T, N, H]`, k, v `[B, T, K, H]` and loss weights `[B, T, N, H]` (every row weighted,
  padding rows included: their outputs must be zero and pass no gradient)."""
  rng = np.random.default_rng(seed)
  q, k, v, w = (jnp.asarray(rng.normal(size=s), dtype)
                for s in ((B, t, n, h), (B, t, kv, h), (B, t, kv, h), (B, t, n, h)))
  return q, k, v, w.astype(jnp.float32)


def packed_ids(t=T):
  """Row 0: segments of 7, 5 and 9 tokens, then 3 padding; row 1: one segment of 20, 4 padding."""
  seg = np.zeros((B, t), np.int32)
  seg[0, :7], seg[0, 7:12], seg[0, 12:21] = 1, 2, 3
  seg[1, :20] = 1
  return seg


def short_ids(t=T):
  """Row 0 as `packed_ids`; row 1: segments of 9 and 12 tokens, then 3 padding. The longest
  segment, 12, ends on token 20, the first of a 4-row block: a band one key short would miss it."""
  seg = packed_ids(t)
  seg[1, 9:21] = 2
  return seg


def branch_ids(t=T):
  """Shared prompts: row 0 = unit 1 (prompt 5, responses of 4 and 3), unit 2 (prompt 3, responses
  of 2 and 2), 5 padding; row 1 = unit 1 (prompt 4, responses 3, 3), unit 2 (prompt 3, responses
  4, 4), 3 padding. The longest unit: 12 tokens."""
  seg, br = np.zeros((B, t), np.int32), np.zeros((B, t), np.int32)
  seg[0, :12], br[0, 5:9], br[0, 9:12] = 1, 1, 2
  seg[0, 12:19], br[0, 15:17], br[0, 17:19] = 2, 1, 2
  seg[1, :10], br[1, 4:7], br[1, 7:10] = 1, 1, 2
  seg[1, 10:21], br[1, 13:17], br[1, 17:21] = 2, 1, 2
  return seg, br


CASES = {"packed": lambda: (packed_ids(), None), "short": lambda: (short_ids(), None),
         "branches": branch_ids}


_packed_layout = jax.jit(attention.packed_layout)


def layout(seg, br=None):
  return _packed_layout(jnp.asarray(seg), None if br is None else jnp.asarray(br))


def reference(q, k, v, lay):
  """The dense reference: one `[B, K, G, T, T]` block on the whole mask."""
  return attention.gqa_attention(q, k, v, attention.dense_mask(lay))


@jax.jit
def reference_value_and_grads(lay, q, k, v, w):
  """`value_and_grads` of the dense reference (jitted)."""
  return value_and_grads(lambda q, k, v: reference(q, k, v, lay), q, k, v, w)


def value_and_grads(fn, q, k, v, w):
  """(sum(out * w), (dq, dk, dv)) of ``fn(q, k, v)``."""
  loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def max_rel_err(got, want) -> float:
  """Largest |got - want| over all leaves, relative to each leaf's largest |want| (at least 1)."""
  errs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    errs.append(np.abs(a - b).max() / max(1.0, np.abs(b).max()))
  return max(errs)
