"""Flash attention over packed rows as Pallas kernels (`attention_impl='pallas'`).

Three kernels, each over (row, query head, block) programs, in the token-major layout the model
keeps (`[B, T, N, H]` queries, `[B, T, K, H]` keys and values: query head n reads key/value head
n // G, so the K heads are never repeated):

- forward: a block of queries runs an online softmax over key blocks and writes the output and
  the row's log-sum-exp (float32);
- dQ: the same key blocks again, with the saved log-sum-exp (no softmax state);
- dK, dV: a block of keys runs over the query blocks that can see it, per query head (the G heads
  of a key/value head are summed afterwards).

Which blocks are visited is decided from the segment ids at run time: a query block starts at the
key block holding the first token of its earliest segment (`SegmentLayout.first`) and stops at
its own causal end; a key block stops at the query block holding the last token of its latest
segment (`SegmentLayout.last`). A row of segments of length w then costs about T (w / 2 + b) score
entries (each segment's causal triangle and a block's worth more) instead of T^2 / 2, whatever
the layout, and padding blocks cost nothing (`tests/models/test_attention_pallas.py` counts the
visited blocks). Inside a visited block the mask (causal, same non-zero segment, shared-prompt
branch) is applied per entry. Padding rows (no allowed key) get zeros.

The forward names its output and log-sum-exp ``attn_out`` / ``attn_lse``
(`jax.ad_checkpoint.checkpoint_name`), so a remat policy that saves them keeps the backward from
running the forward kernel again (`transformer.remat_policy`: 'save_attn' and up).

Written for the Triton lowering (GPU) and run on CPU with ``interpret=True`` (the tests). Rows are
padded to a multiple of the blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from disa_jax.models import attention as A

BLOCK = 64  # default query / key rows per block (GPU); tests use smaller ones
_NONE = 1 << 30  # "no token": larger than any index


@dataclasses.dataclass(frozen=True)
class PallasConfig:
  """Static settings of one kernel family (hashable: a `custom_vjp` static argument)."""
  block_q: int
  block_k: int
  interpret: bool
  branches: bool  # shared-prompt branch ids are passed


def _dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False
         ) -> jax.Array:
  """`a @ b` with optional transposes, accumulated in float32 (full precision for float32)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _tile_mask(q_ids, k_ids, q_start, k_start, bq: int, bk: int) -> jax.Array:
  """`[bq, bk]` bool of one tile; ids are `(segment, branch | None)` vectors of the tile."""
  (sq, brq), (sk, brk) = q_ids, k_ids
  causal = (q_start + jnp.arange(bq))[:, None] >= (k_start + jnp.arange(bk))[None, :]
  mask = causal & (sq[:, None] == sk[None, :]) & (sk[None, :] > 0)
  if brq is not None:
    mask &= (brk[None, :] == 0) | (brk[None, :] == brq[:, None])
  return mask


def _key_range(sq, first_q, i, cfg: PallasConfig):
  """Key blocks `[start, stop)` of query block i: from its earliest segment's first token to its
  causal end; empty when the block holds no real query."""
  lo = jnp.min(jnp.where(sq > 0, first_q, _NONE))
  stop = lax.div((i + 1) * cfg.block_q + cfg.block_k - 1, cfg.block_k)
  return lax.div(lo, cfg.block_k), jnp.where(lo < _NONE, stop, 0)


def _query_range(sk, last_k, j, cfg: PallasConfig):
  """Query blocks `[start, stop)` that can see key block j: from its own (causal) to the one
  holding its latest segment's last token; empty when the block holds no real key."""
  hi = jnp.max(jnp.where(sk > 0, last_k, -1))
  return lax.div(j * cfg.block_k, cfg.block_q), jnp.where(hi >= 0, lax.div(hi, cfg.block_q) + 1, 0)


def _ids(refs, cfg: PallasConfig, sl=None):
  """(segment, branch | None) vectors from refs `(seg, branch?)`, whole or sliced."""
  seg = refs[0][...] if sl is None else refs[0][sl]
  if not cfg.branches:
    return seg, None
  return seg, refs[1][...] if sl is None else refs[1][sl]


def _fwd_kernel(*refs, cfg: PallasConfig, scale: float):
  nb = 2 if cfg.branches else 1
  q_ref, k_ref, v_ref = refs[:3]
  qid_refs, kid_refs = refs[3:3 + nb], refs[3 + nb:3 + 2 * nb]
  first_ref, o_ref, lse_ref = refs[3 + 2 * nb:]
  i = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q = q_ref[...]
  q_ids = _ids(qid_refs, cfg)
  start, stop = _key_range(q_ids[0], first_ref[...], i, cfg)

  def body(j, carry):
    acc, m, l = carry
    sl = pl.ds(j * bk, bk)
    k, v = k_ref[sl, :], v_ref[sl, :]
    mask = _tile_mask(q_ids, _ids(kid_refs, cfg, sl), i * bq, j * bk, bq, bk)
    s = jnp.where(mask, _dot(q, k, trans_b=True) * scale, A.MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return (alpha[:, None] * acc + _dot(p.astype(v.dtype), v), m_new,
            alpha * l + jnp.sum(p, axis=1))

  init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), A.MASK_VALUE, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  acc, m, l = lax.fori_loop(start, stop, body, init)
  real = l > 0
  safe_l = jnp.where(real, l, 1.0)
  o_ref[...] = jnp.where(real[:, None], acc / safe_l[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(real, m + jnp.log(safe_l), 0.0)


def _dq_kernel(*refs, cfg: PallasConfig, scale: float):
  nb = 2 if cfg.branches else 1
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qid_refs, kid_refs = refs[6:6 + nb], refs[6 + nb:6 + 2 * nb]
  first_ref, dq_ref = refs[6 + 2 * nb:]
  i = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
  q_ids = _ids(qid_refs, cfg)
  start, stop = _key_range(q_ids[0], first_ref[...], i, cfg)

  def body(j, dq):
    sl = pl.ds(j * bk, bk)
    k, v = k_ref[sl, :], v_ref[sl, :]
    mask = _tile_mask(q_ids, _ids(kid_refs, cfg, sl), i * bq, j * bk, bq, bk)
    p = jnp.where(mask, jnp.exp(_dot(q, k, trans_b=True) * scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, trans_b=True) - delta[:, None]) * scale
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(start, stop, body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: PallasConfig, scale: float):
  nb = 2 if cfg.branches else 1
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
  qid_refs, kid_refs = refs[6:6 + nb], refs[6 + nb:6 + 2 * nb]
  last_ref, dk_ref, dv_ref = refs[6 + 2 * nb:]
  j = pl.program_id(2)
  bq, bk = cfg.block_q, cfg.block_k
  k, v = k_ref[...], v_ref[...]
  k_ids = _ids(kid_refs, cfg)
  start, stop = _query_range(k_ids[0], last_ref[...], j, cfg)

  def body(i, carry):
    dk, dv = carry
    sl = pl.ds(i * bq, bq)
    q, do, lse, delta = q_ref[sl, :], do_ref[sl, :], lse_ref[sl], delta_ref[sl]
    mask = _tile_mask(_ids(qid_refs, cfg, sl), k_ids, i * bq, j * bk, bq, bk)
    p = jnp.where(mask, jnp.exp(_dot(q, k, trans_b=True) * scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, trans_b=True) - delta[:, None]) * scale
    return (dk + _dot(ds.astype(q.dtype), q, trans_a=True),
            dv + _dot(p.astype(do.dtype), do, trans_a=True))

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(start, stop, body, (zeros, zeros))
  dk_ref[...], dv_ref[...] = dk, dv


def _specs(shape_q, groups: int, cfg: PallasConfig, *, per: str):
  """BlockSpecs over the grid (row, query head, block): ``per`` = 'q' (blocks of queries) or 'k'
  (blocks of keys). Returns a dict: 'own' (this block of tokens, its own head), 'full_q' (the
  whole row of q, this head), 'full_kv' / 'own_kv' (k / v of the whole row / this block, the
  query head's k/v head), 'row_own' / 'row_full' (ids of this block / the whole row), 'stat_own' /
  'stat_full' (lse / delta of this block / the whole row)."""
  _, tp, _, h = shape_q
  b_own = cfg.block_q if per == "q" else cfg.block_k
  own = pl.BlockSpec((None, b_own, None, h), lambda b, n, i: (b, i, n, 0))
  full_q = pl.BlockSpec((None, tp, None, h), lambda b, n, i: (b, 0, n, 0))
  full_kv = pl.BlockSpec((None, tp, None, h), lambda b, n, i: (b, 0, n // groups, 0))
  own_kv = pl.BlockSpec((None, b_own, None, h), lambda b, n, i: (b, i, n // groups, 0))
  row_own = pl.BlockSpec((None, b_own), lambda b, n, i: (b, i))
  row_full = pl.BlockSpec((None, tp), lambda b, n, i: (b, 0))
  stat_own = pl.BlockSpec((None, None, b_own), lambda b, n, i: (b, n, i))
  stat_full = pl.BlockSpec((None, None, tp), lambda b, n, i: (b, n, 0))
  return dict(own=own, full_q=full_q, full_kv=full_kv, own_kv=own_kv, row_own=row_own,
              row_full=row_full, stat_own=stat_own, stat_full=stat_full)


def _id_args(ids, cfg: PallasConfig) -> list[jax.Array]:
  seg, branch = ids[0], ids[1]
  return [seg, branch] if cfg.branches else [seg]


def _call(kernel, grid, in_specs, out_specs, out_shape, cfg: PallasConfig, name: str, *args):
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                        out_shape=out_shape, interpret=cfg.interpret, name=name)(*args)


def _forward(q, k, v, ids, cfg: PallasConfig):
  b, tp, n, h = q.shape
  s = _specs(q.shape, n // k.shape[2], cfg, per="q")
  idx = _id_args(ids, cfg)
  in_specs = ([s["own"], s["full_kv"], s["full_kv"]] + [s["row_own"]] * len(idx)
              + [s["row_full"]] * len(idx) + [s["row_own"]])
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
  kernel = functools.partial(_fwd_kernel, cfg=cfg, scale=1.0 / math.sqrt(h))
  return _call(kernel, (b, n, tp // cfg.block_q), in_specs, [s["own"], s["stat_own"]], out_shape,
               cfg, "segment_flash_fwd", q, k, v, *idx, *idx, ids[2])


def _backward(q, k, v, ids, o, lse, do, cfg: PallasConfig):
  b, tp, n, h = q.shape
  kv_heads = k.shape[2]
  g, scale = n // kv_heads, 1.0 / math.sqrt(h)
  delta = jnp.einsum("btnh,btnh->bnt", do.astype(jnp.float32), o.astype(jnp.float32))
  idx = _id_args(ids, cfg)
  sq = _specs(q.shape, g, cfg, per="q")
  dq = _call(functools.partial(_dq_kernel, cfg=cfg, scale=scale), (b, n, tp // cfg.block_q),
             [sq["own"], sq["full_kv"], sq["full_kv"], sq["own"], sq["stat_own"], sq["stat_own"]]
             + [sq["row_own"]] * len(idx) + [sq["row_full"]] * len(idx) + [sq["row_own"]],
             sq["own"], jax.ShapeDtypeStruct(q.shape, q.dtype), cfg, "segment_flash_dq",
             q, k, v, do, lse, delta, *idx, *idx, ids[2])
  sk = _specs(q.shape, g, cfg, per="k")
  per_head = jax.ShapeDtypeStruct((b, tp, n, h), jnp.float32)
  dk, dv = _call(functools.partial(_dkv_kernel, cfg=cfg, scale=scale), (b, n, tp // cfg.block_k),
                 [sk["full_q"], sk["own_kv"], sk["own_kv"], sk["full_q"], sk["stat_full"],
                  sk["stat_full"]] + [sk["row_full"]] * len(idx) + [sk["row_own"]] * len(idx)
                 + [sk["row_own"]], [sk["own"], sk["own"]], [per_head, per_head], cfg,
                 "segment_flash_dkv", q, k, v, do, lse, delta, *idx, *idx, ids[3])
  fold = lambda x: x.reshape(b, tp, kv_heads, g, h).sum(axis=3).astype(k.dtype)
  return dq, fold(dk), fold(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, ids, cfg: PallasConfig):
  return _forward(q, k, v, ids, cfg)[0]


def _flash_fwd(q, k, v, ids, cfg):
  o, lse = _forward(q, k, v, ids, cfg)
  o, lse = checkpoint_name(o, "attn_out"), checkpoint_name(lse, "attn_lse")
  return o, (q, k, v, ids, o, lse)


def _flash_bwd(cfg, res, do):
  q, k, v, ids, o, lse = res
  dq, dk, dv = _backward(q, k, v, ids, o, lse, do, cfg)
  return dq, dk, dv, jax.tree.map(lambda _: None, ids)


_flash.defvjp(_flash_fwd, _flash_bwd)


def pallas_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout, *,
                     block_q: int = BLOCK, block_k: int = BLOCK,
                     interpret: bool | None = None) -> jax.Array:
  """Grouped-query self-attention over packed rows by the Pallas kernels (module docstring).

  Args:
    q: `[B, T, N, H]` queries.
    k: `[B, T, K, H]` keys.
    v: `[B, T, K, H]` values.
    layout: the rows' `SegmentLayout`.
    block_q, block_k: rows per query / key block (powers of two >= 16 on a GPU).
    interpret: run the kernels in the Pallas interpreter (default: on the CPU backend).

  Returns:
    `[B, T, N, H]` in q's dtype; zero on padding rows.
  """
  b, t, n, h = q.shape
  if k.shape[1] != t or layout.segment_ids.shape != (b, t):
    raise ValueError(f"self-attention over a layout needs q, k and segment ids of one length, got "
                     f"q {q.shape}, k {k.shape}, segment_ids {layout.segment_ids.shape}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  cfg = PallasConfig(block_q, block_k, interpret, layout.branch_ids is not None)
  tp = -(-t // math.lcm(block_q, block_k)) * math.lcm(block_q, block_k)
  pad_tokens = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  branch = layout.branch_ids if cfg.branches else jnp.zeros((0,), jnp.int32)
  ids = tuple(pad_tokens(x) if x.ndim == 2 else x
              for x in (layout.segment_ids, branch, layout.first, layout.last))
  out = _flash(pad_tokens(q), pad_tokens(k), pad_tokens(v), ids, cfg)
  return out[:, :t]
