"""Continuous batching on a ragged KV cache: the JAX sampler's decode path for a request with more
rows than slots or a long cache (what its default, 'auto', runs there; `cache_layout='ragged'`
runs every request on it).

One jitted call samples every row (prompt p, sample s) of a request. B decode *slots* share one KV
cache, `decode_attention.RaggedKV`'s `[L, B, K, S, H]` (S = the padded prompt length Tp + the
max_tokens bucket N), passed in donated and updated in place: it is the only copy of the cache in
the program (`tests/rollout/test_continuous.py` checks the compiled program's memory). Slot b holds
one row: its left-padded prompt at ``[start_b, Tp)``, its generated tokens from Tp on. Each
iteration of the decode loop

1. *admits* waiting rows while at least U slots are free (U = `admission_rows`): their prompts
   are prefilled (one prefill per group of g rows of the same prompt, its cache repeated to its g
   rows, as the dense path does for a prompt's n samples), written into the free slots (one
   transpose to the head-major layout per admitted row, never per step), and their first tokens
   sampled;
2. runs one decode step for all slots: every live slot feeds its last token, attends over its
   own live entries only (`decode_attention.ragged_attention`), and samples its next one. A row
   that emits a stop token or reaches max_tokens frees its slot for the next waiting row.

The loop ends when no row waits and no slot is live. A row's tokens do not depend on its slot or
on when it ran (`sampling`), so this path samples what the dense reference
(`jax_sampler.JaxSampler(cache_layout='dense')`) does, up to float32 rounding of the attention
(blocked online softmax against one softmax).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from disa_jax.models.config import ModelConfig
from disa_jax.models.decode_attention import RaggedKV
from disa_jax.models.kv_bits import as_bits, bits_dtype
from disa_jax.rollout.sampling import prompt_positions, sample_step


def admission_rows(slots: int, n: int) -> int:
  """Rows admitted together (U): whole groups of a prompt's ``n`` samples (one prefill each) when
  ``n`` <= slots, about slots / 8 of them (few slots idle while U free up, few prefills); else
  the largest divisor of ``n`` up to slots / 8 (part of one prompt's samples)."""
  target = max(1, slots // 8)
  if n <= slots:
    return n * max(1, target // n)
  return max(d for d in range(1, target + 1) if n % d == 0)


def cache_bytes(config: ModelConfig, rows: int, length: int, dtype: Any) -> int:
  """Bytes of a KV cache of ``rows`` sequences of ``length`` tokens: rows x length x L x 2 (k, v)
  x K x H x itemsize."""
  return (rows * length * config.num_layers * 2 * config.num_kv_heads * config.head_dim
          * jnp.dtype(dtype).itemsize)


def empty_cache(config: ModelConfig, slots: int, length: int, dtype: Any) -> dict[str, jax.Array]:
  """Zeroed head-major k and v, `[L, slots, K, length, H]` each, as the bits of ``dtype`` values
  (`decode_attention.as_bits`; zeros: a never-written value times a zero probability must stay 0,
  and 0 is the bits of 0.0)."""
  shape = (config.num_layers, slots, config.num_kv_heads, length, config.head_dim)
  return {"k": jnp.zeros(shape, bits_dtype(dtype)), "v": jnp.zeros(shape, bits_dtype(dtype))}


class _Loop(NamedTuple):
  """The decode loop's carry (B slots, R rows, N output columns)."""
  k: jax.Array  # [L, B, K, S, H]
  v: jax.Array
  slot_row: jax.Array  # [B] the row a slot holds
  slot_start: jax.Array  # [B] first live cache entry (Tp - prompt length)
  slot_gen: jax.Array  # [B] tokens its row has generated
  slot_tok: jax.Array  # [B] its row's last token (not yet in the cache)
  live: jax.Array  # [B] bool
  admitted: jax.Array  # rows admitted so far
  steps: jax.Array  # decode steps run
  out_tok: jax.Array  # [R, N]
  out_lp: jax.Array
  out_raw: jax.Array
  out_len: jax.Array  # [R]
  out_stop: jax.Array  # [R] bool


class _Request(NamedTuple):
  """The call's inputs the loop reads (P prompts, R rows)."""
  prompt_ids: jax.Array  # [P, Tp] left-padded
  prompt_mask: jax.Array  # [P, Tp] 1 = real token
  row_prompt: jax.Array  # [R] the prompt of each row
  num_rows: jax.Array  # rows that are real (the rest is padding)
  keys: jax.Array  # [R, 2]
  max_new: jax.Array
  sampling: tuple  # temperature, top_k, top_p
  stop_mask: jax.Array  # [V] bool


def _admit(model, c: _Loop, r: _Request, unit: int, group: int, dtype: str) -> _Loop:
  """Prefills the next ``unit`` rows into free slots and samples their first tokens."""
  prompt_len = r.prompt_ids.shape[1]
  slots = jnp.nonzero(~c.live, size=unit, fill_value=0)[0]  # [U] (>= U are free)
  rows = c.admitted + jnp.arange(unit, dtype=jnp.int32)  # [U]
  active = rows < r.num_rows
  prompts = r.row_prompt[c.admitted + jnp.arange(0, unit, group, dtype=jnp.int32)]  # [U / g]
  ids, mask = r.prompt_ids[prompts], r.prompt_mask[prompts]
  pre = model.init_cache(unit // group, prompt_len, dtype=dtype)  # [L, U/g, Tp, K, H]
  positions = prompt_positions(mask)
  logits, pre = model.forward_with_cache(ids, positions, pre, jnp.int32(0), mask.astype(bool),
                                         last_only=True)
  k, v = (c_.at[:, slots, :, :prompt_len, :].set(
      as_bits(jnp.repeat(pre[name].transpose(0, 1, 3, 2, 4), group, axis=1)))  # head-major
          for c_, name in ((c.k, "k"), (c.v, "v")))
  logits = jnp.repeat(logits[:, -1], group, axis=0)  # [U, V]
  tok, lp, raw = sample_step(logits, r.keys[rows], jnp.int32(0), *r.sampling)
  stop = r.stop_mask[tok] & active
  live = active & ~stop & (r.max_new > 1)
  real_len = jnp.repeat(jnp.sum(mask, axis=1), group).astype(jnp.int32)
  return c._replace(
      k=k, v=v, slot_row=c.slot_row.at[slots].set(rows),
      slot_start=c.slot_start.at[slots].set(prompt_len - real_len),
      slot_gen=c.slot_gen.at[slots].set(1), slot_tok=c.slot_tok.at[slots].set(tok),
      live=c.live.at[slots].set(live), admitted=c.admitted + unit,
      out_tok=c.out_tok.at[rows, 0].set(jnp.where(active, tok, 0)),
      out_lp=c.out_lp.at[rows, 0].set(jnp.where(active, lp, 0.0)),
      out_raw=c.out_raw.at[rows, 0].set(jnp.where(active, raw, 0.0)),
      out_len=c.out_len.at[rows].set(active.astype(jnp.int32)),
      out_stop=c.out_stop.at[rows].set(stop))


def _decode(model, c: _Loop, r: _Request, block: int, dtype: str) -> _Loop:
  """One decode step of every slot; dead slots compute on a one-entry range and are dropped."""
  prompt_len = r.prompt_ids.shape[1]
  live = c.live
  first = jnp.min(jnp.where(live, c.slot_start, prompt_len))  # dead slots stay in live blocks
  write = jnp.where(live, prompt_len + c.slot_gen - 1, first)
  start = jnp.where(live, c.slot_start, first)
  cache = RaggedKV(c.k, c.v, write, start, block, dtype)
  logits, cache = model.decode_ragged(c.slot_tok[:, None], (write - start)[:, None], cache)
  tok, lp, raw = sample_step(logits[:, 0], r.keys[c.slot_row], c.slot_gen, *r.sampling)
  row = jnp.where(live, c.slot_row, c.out_len.shape[0])  # dead slots: out of range, dropped
  col = c.slot_gen
  gen = c.slot_gen + live.astype(jnp.int32)
  stop = r.stop_mask[tok]
  return c._replace(
      k=cache.k, v=cache.v, slot_gen=gen, slot_tok=jnp.where(live, tok, c.slot_tok),
      live=live & ~stop & (gen < r.max_new), steps=c.steps + 1,
      out_tok=c.out_tok.at[row, col].set(tok, mode="drop"),
      out_lp=c.out_lp.at[row, col].set(lp, mode="drop"),
      out_raw=c.out_raw.at[row, col].set(raw, mode="drop"),
      out_len=c.out_len.at[row].set(gen, mode="drop"),
      out_stop=c.out_stop.at[row].set(stop, mode="drop"))


def init_loop(cache: dict[str, jax.Array], rows: int, num_new: int) -> _Loop:
  """The decode loop's first carry: every slot free, nothing admitted, empty outputs."""
  slots = cache["k"].shape[1]
  zeros = jnp.zeros((slots,), jnp.int32)
  return _Loop(k=cache["k"], v=cache["v"], slot_row=zeros, slot_start=zeros,
               slot_gen=zeros + 1, slot_tok=zeros, live=jnp.zeros((slots,), bool),
               admitted=jnp.int32(0), steps=jnp.int32(0),
               out_tok=jnp.zeros((rows, num_new), jnp.int32),
               out_lp=jnp.zeros((rows, num_new), jnp.float32),
               out_raw=jnp.zeros((rows, num_new), jnp.float32),
               out_len=jnp.zeros((rows,), jnp.int32), out_stop=jnp.zeros((rows,), bool))


def abstract_request(*, prompts: int, prompt_len: int, rows: int, vocab: int,
                     sharding: Any = None) -> _Request:
  """A `_Request` of `jax.ShapeDtypeStruct`s (placed by ``sharding``, e.g. on the abstract
  devices of `disa_jax.parallel.gpu_compile`), to lower the steps below without data."""
  sds = lambda dtype, *shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  i32, f32 = jnp.int32, jnp.float32
  return _Request(sds(i32, prompts, prompt_len), sds(i32, prompts, prompt_len), sds(i32, rows),
                  sds(i32), sds(jnp.uint32, rows, 2), sds(i32), (sds(f32), sds(i32), sds(f32)),
                  sds(bool, vocab))


def prefill_step(graphdef: Any, state: Any, c: _Loop, r: _Request, *, unit: int, group: int,
                 cache_dtype: str) -> _Loop:
  """One admission of the decode loop (`generate`'s: ``unit`` rows prefilled into free slots),
  as its own program (compile reports; jit it with ``c`` donated)."""
  return _admit(nnx.merge(graphdef, state), c, r, unit, group, cache_dtype)


def decode_step(graphdef: Any, state: Any, c: _Loop, r: _Request, *, block: int,
                cache_dtype: str) -> _Loop:
  """One decode step of every slot (`generate`'s loop body after admission), as its own program
  (compile reports; jit it with ``c`` donated)."""
  return _decode(nnx.merge(graphdef, state), c, r, block, cache_dtype)


def generate(graphdef: Any, state: Any, cache: dict[str, jax.Array], prompt_ids: jax.Array,
             prompt_mask: jax.Array, row_prompt: jax.Array, num_rows: jax.Array, keys: jax.Array,
             max_new: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
             stop_mask: jax.Array, *, num_new: int, unit: int, group: int, block: int,
             cache_dtype: str):
  """Samples every row of a request on B slots (see the module docstring); jit it with the cache
  donated.

  Args:
    graphdef, state: the model (`nnx.split`).
    cache: `empty_cache(config, B, Tp + num_new, cache_dtype)`, donated.
    prompt_ids: `[P, Tp]` int32 left-padded prompts.
    prompt_mask: `[P, Tp]` int32, 1 = real token.
    row_prompt: `[R]` int32, the prompt of each row (R a multiple of ``unit``; rows of one prompt
      consecutive, each prompt's first row at a multiple of ``group``).
    num_rows: int32 scalar, the real rows (the first ones); the rest is padding.
    keys: `[R, 2]` uint32 per-row keys.
    max_new: int32 scalar <= num_new, tokens to generate at most.
    temperature, top_k, top_p: sampling scalars (`sampling.sample_step`).
    stop_mask: `[V]` bool, True for stop tokens.
    num_new: static N, the output columns.
    unit: static U, rows admitted together (`admission_rows`).
    group: static g, rows of one prompt that share a prefill (divides U).
    block: static attention block (divides Tp + num_new).
    cache_dtype: static, the dtype of the cache's values (it holds their bits).

  Returns:
    tokens `[R, N]` int32, logprobs `[R, N]`, raw logprobs `[R, N]`, lengths `[R]`, stopped
    `[R]`, 1 + the decode steps run (int32 scalar), and the cache (the donated buffers).
  """
  model = nnx.merge(graphdef, state)
  r = _Request(prompt_ids, prompt_mask, row_prompt, num_rows, keys, max_new,
               (temperature, top_k, top_p), stop_mask)
  c = init_loop(cache, keys.shape[0], num_new)

  def can_admit(c: _Loop):
    return (c.admitted < num_rows) & (jnp.sum(~c.live) >= unit)

  def body(c: _Loop) -> _Loop:
    c = jax.lax.while_loop(can_admit, lambda c: _admit(model, c, r, unit, group, cache_dtype), c)
    return jax.lax.cond(jnp.any(c.live), lambda c: _decode(model, c, r, block, cache_dtype),
                        lambda c: c, c)

  c = jax.lax.while_loop(lambda c: (c.admitted < num_rows) | jnp.any(c.live), body, c)
  return (c.out_tok, c.out_lp, c.out_raw, c.out_len, c.out_stop, c.steps + 1,
          {"k": c.k, "v": c.v})
