"""The JAX sampler: the default rollout engine, on `Transformer`'s KV-cache API.

Two decode paths (``cache_layout``; 'auto' picks one per request), both one jitted call per
request that runs prefill and decode in `lax.while_loop`s which exit as soon as every row is done:

* 'ragged' (`disa_jax.rollout.continuous`): continuous batching of the rows on ``max_batch_size``
  slots of one head-major KV cache, donated and updated in place; each slot attends over its own
  live entries only, and a row that stops frees its slot for a waiting row.
* 'dense' (the reference the ragged path is tested against): the rows in chunks of
  ``max_batch_size``; each chunk runs to its longest row on a `[L, B, S, K, H]` cache created in
  the program, every row attending over all S positions.
* 'auto' (default): 'dense' for a request whose rows all fit ``max_batch_size`` on a cache of at
  most ``decode_block`` positions (S = the padded prompt + the max_tokens bucket), 'ragged'
  otherwise. With every row admitted at once no row waits, so continuous batching has nothing to
  refill, and on a cache that short attending over every position costs nothing that the live
  ranges would save: the dense path is the cheaper one (the Stage 3 bench's 64-row request,
  11.3-11.7 against 14.8-14.9 ms a call on a 2-core CPU, 40% of it the ragged path's 8
  admissions, 60% its decode steps; benchmarks/results/sampler_phases_cpu_20261207.txt). A
  request with more rows than slots, or a long cache (Stage 3 at 16k tokens), runs ragged. The
  two paths round attention differently, so the pipeline job's presets, whose committed reports
  were drawn on the ragged path, name 'ragged' (`configs/main.py`).

The n samples of a prompt share one prefill: the prompt runs once and its KV cache is repeated to
its rows. Prompts are left-padded; the batch (slots), the padded prompt length and the number of
new tokens are rounded up to powers of two, and the sampling parameters (temperature, top-k, top-p,
stop tokens, max_tokens) are traced values, so new prompt lengths or parameters do not recompile.

Randomness: each sample (prompt p, sample j) draws from its own key `fold_in(fold_in(key(seed), p),
j)`, folded with the token's column, so a sample does not depend on what else is in the batch
(`disa_jax.rollout.sampling`).

Weights: `update_weights` takes HF-named arrays (`models.load_hf_state_dict`) or, from a flat push,
`flat_weights.FlatWeights` (one host -> device copy per bucket and a jitted split into the model's
own layouts).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax import models
from disa_jax.rollout import continuous, flat_weights
from disa_jax.rollout.sampling import bucket as _bucket
from disa_jax.rollout.sampling import prompt_positions, row_keys, sample_step
from disa_jax.rollout.types import Completion, SamplingParams, validate_prompts

CACHE_LAYOUTS = ("ragged", "dense", "auto")
PROGRAMS = ("generate", "prefill", "decode")  # `JaxSampler.lower_programs`


def _generate_dense(graphdef, state, input_ids, prompt_mask, active, keys, max_new, temperature,
                    top_k, top_p, stop_mask, *, num_new: int, cache_dtype: Any, group: int = 1):
  """The dense reference path: prefill + decode loop for one chunk of rows.

  Args:
    input_ids: `[B / g, Tp]` int32 left-padded prompts, one per group of g consecutive rows.
    prompt_mask: `[B / g, Tp]` int32, 1 = real token.
    active: `[B]` bool, False for batch-padding rows (they start finished).
    keys: `[B, 2]` uint32 per-row keys.
    max_new: int32 scalar <= num_new, tokens to generate at most.
    stop_mask: `[V]` bool, True for stop tokens.
    num_new: static size of the output buffers (the max_tokens bucket).
    group: static g, rows per prompt: the prompt is prefilled once and its KV cache and last
      logits are repeated to its g rows (n samples of one prompt start from the same state).

  Returns:
    tokens `[B, N]` int32, logprobs `[B, N]`, raw logprobs `[B, N]`, lengths `[B]`, stopped `[B]`,
    and the number of decoding steps run (int32 scalar; < max_new when every row stopped early).
  """
  model = nnx.merge(graphdef, state)
  prompts, prompt_len = input_ids.shape
  batch = active.shape[0]
  cache_len = prompt_len + num_new
  cache = model.init_cache(prompts, cache_len, dtype=cache_dtype)
  kv_mask = jnp.zeros((prompts, cache_len), bool).at[:, :prompt_len].set(prompt_mask.astype(bool))
  positions = prompt_positions(prompt_mask)
  # Left padding: the last column holds every row's last prompt token.
  logits, cache = model.forward_with_cache(input_ids, positions, cache, jnp.int32(0), kv_mask,
                                           last_only=True)
  if group > 1:  # [B / g, ...] -> [B, ...]: each prompt's state for its g samples
    logits, kv_mask, prompt_mask = (jnp.repeat(x, group, axis=0)
                                    for x in (logits, kv_mask, prompt_mask))
    cache = {k: jnp.repeat(v, group, axis=1) for k, v in cache.items()}  # [L, B, S, K, H]
  tok, lp, raw = sample_step(logits[:, -1], keys, jnp.int32(0), temperature, top_k, top_p)
  real_len = jnp.sum(prompt_mask, axis=1).astype(jnp.int32)  # [B]
  out_tok = jnp.zeros((batch, num_new), jnp.int32).at[:, 0].set(tok)
  out_lp = jnp.zeros((batch, num_new), jnp.float32).at[:, 0].set(lp)
  out_raw = jnp.zeros((batch, num_new), jnp.float32).at[:, 0].set(raw)
  lengths = active.astype(jnp.int32)
  done = ~active | stop_mask[tok]

  def cond(carry):
    step, _, _, _, _, done, _, _, _ = carry
    return (step < max_new) & ~jnp.all(done)

  def body(carry):
    step, out_tok, out_lp, out_raw, lengths, done, cache, kv_mask, tok = carry
    slot = prompt_len + step - 1  # the slot of the token fed in this step
    kv_mask = jax.lax.dynamic_update_slice(kv_mask, jnp.ones((batch, 1), bool), (0, slot))
    pos = (real_len + step - 1)[:, None]  # [B, 1]
    logits, cache = model.forward_with_cache(tok[:, None], pos, cache, slot, kv_mask)
    new_tok, lp, raw = sample_step(logits[:, 0], keys, step, temperature, top_k, top_p)
    live = ~done
    new_tok = jnp.where(live, new_tok, 0)
    # Write column `step` of the [B, N] outputs.
    out_tok = jax.lax.dynamic_update_slice(out_tok, new_tok[:, None], (0, step))
    out_lp = jax.lax.dynamic_update_slice(out_lp, jnp.where(live, lp, 0.0)[:, None], (0, step))
    out_raw = jax.lax.dynamic_update_slice(out_raw, jnp.where(live, raw, 0.0)[:, None], (0, step))
    lengths = lengths + live.astype(jnp.int32)
    done = done | (live & stop_mask[new_tok])
    return step + 1, out_tok, out_lp, out_raw, lengths, done, cache, kv_mask, new_tok

  carry = (jnp.int32(1), out_tok, out_lp, out_raw, lengths, done, cache, kv_mask, tok)
  steps, out_tok, out_lp, out_raw, lengths, done, _, _, _ = jax.lax.while_loop(cond, body, carry)
  stopped = done & active
  return out_tok, out_lp, out_raw, lengths, stopped, steps


def _left_pad(prompts: Sequence[np.ndarray], rows: int, width: int
              ) -> tuple[np.ndarray, np.ndarray]:
  """`[rows, width]` int32 ids and mask of left-padded prompts; rows past the prompts hold one
  dummy token."""
  ids = np.zeros((rows, width), np.int32)
  mask = np.zeros((rows, width), np.int32)
  for r, p in enumerate(prompts):
    ids[r, width - len(p):] = p
    mask[r, width - len(p):] = 1
  mask[len(prompts):, -1] = 1
  return ids, mask


def _committed(state: nnx.State) -> nnx.State:
  """``state`` with every array committed to its placement (no copy where it already is): a jitted
  call's cache tells committed arguments from uncommitted ones, and the weight pushes
  (`load_params`) give committed arrays, so uncommitted starting weights compiled each generate
  program twice per process (2 x ~3 s at the default job's two request shapes)."""
  return jax.tree.map(lambda x: x if getattr(x, "committed", True) else
                      jax.device_put(x, x.sharding), state)


def _completions(out, count: int, with_raw: bool) -> list[Completion]:
  """The first ``count`` rows of a jitted call's (tokens, logprobs, raw, lengths, stopped)."""
  tok, lp, raw, lengths, stopped = (np.asarray(x) for x in out[:5])
  return [Completion(token_ids=tok[r, :lengths[r]], logprobs=lp[r, :lengths[r]],
                     raw_logprobs=raw[r, :lengths[r]] if with_raw else None,
                     finish_reason="stop" if stopped[r] else "length") for r in range(count)]


class JaxSampler:
  """Samples from a `disa_jax.models.Transformer` in this process; implements `Engine`.

  Args:
    model: the model (its weights are updated in place by `update_weights`).
    max_batch_size: rows (prompts x n) decoded at once: the slots of the ragged cache (more rows
      wait for a free slot), or the chunk size of the dense path.
    min_batch_bucket: smallest padded batch (fewer distinct shapes to compile).
    min_prompt_bucket: smallest padded prompt length.
    min_new_bucket: smallest output buffer length.
    cache_dtype: KV-cache dtype (default: the model's computation dtype).
    cache_layout: 'ragged' (continuous batching, `disa_jax.rollout.continuous`), 'dense' (the
      reference) or 'auto' (dense when every row of a request fits ``max_batch_size`` on a cache
      of at most ``decode_block`` positions; see the module docstring).
    decode_block: ragged attention block, in positions (a power of two; capped by the padded
      prompt and output lengths, so it divides the cache length).

  The ragged path's decode attention is the model's (`ModelOptions.decode_attention`: 'xla', the
  reference loop over every cache block, 'xla_live' over the live ones, 'pallas', one kernel for
  every layer, or 'auto'; `from_pretrained` passes it to the model).
  """

  def __init__(self, model: models.Transformer, *, max_batch_size: int = 256,
               min_batch_bucket: int = 8, min_prompt_bucket: int = 16, min_new_bucket: int = 16,
               cache_dtype: Any = None, cache_layout: str = "auto", decode_block: int = 256):
    if max_batch_size < 1:
      raise ValueError(f"JaxSampler.max_batch_size must be >= 1, got {max_batch_size}")
    if cache_layout not in CACHE_LAYOUTS:
      raise ValueError(f"JaxSampler.cache_layout must be one of {CACHE_LAYOUTS}, got "
                       f"{cache_layout!r}")
    if not (isinstance(decode_block, int) and decode_block >= 1
            and decode_block & (decode_block - 1) == 0):
      raise ValueError(f"JaxSampler.decode_block must be a power of two, got {decode_block!r}")
    self.model = model
    self.vocab_size = model.config.vocab_size
    self.max_batch_size = max_batch_size
    self.min_batch_bucket = min_batch_bucket
    self.min_prompt_bucket = min_prompt_bucket
    self.min_new_bucket = min_new_bucket
    self.cache_dtype = jnp.dtype(cache_dtype or model.dtype)
    self.cache_layout = cache_layout
    self.decode_block = decode_block
    self._graphdef, self._state = nnx.split(model)
    self._state = _committed(self._state)
    self._fns: dict[tuple, Any] = {}
    self._copy: tuple | None = None  # (source, dtype, `flat_weights.DeviceCopy`) of load_params
    self._closed = False
    self.last_num_steps = 0  # 1 + decoding steps of the last jitted call (for tests and stats)

  @classmethod
  def from_pretrained(cls, model_path: str, *, dtype: str = "float32",
                      **kwargs: Any) -> "JaxSampler":
    """Loads a local HF checkpoint with `disa_jax.models.from_pretrained`: the ``kwargs`` that are
    `ModelOptions` fields (``decode_attention``, ``layer_loop``, ...) go to the model, the others
    to the sampler (so one ``engine.jax_kwargs`` section configures both)."""
    names = {f.name for f in dataclasses.fields(models.ModelOptions)}
    model_kwargs = {k: v for k, v in kwargs.items() if k in names}
    sampler_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    return cls(models.from_pretrained(model_path, dtype=jnp.dtype(dtype), **model_kwargs),
               **sampler_kwargs)

  def _fn(self, key: tuple):
    """The jitted program of ``key``: ('dense', num_new, group) or ('ragged', num_new, unit,
    group, block)."""
    if key not in self._fns:
      if key[0] == "dense":
        self._fns[key] = jax.jit(functools.partial(
            _generate_dense, self._graphdef, num_new=key[1], cache_dtype=self.cache_dtype,
            group=key[2]))
      else:
        self._fns[key] = jax.jit(functools.partial(
            continuous.generate, self._graphdef, num_new=key[1], unit=key[2], group=key[3],
            block=key[4], cache_dtype=self.cache_dtype.name), donate_argnums=(1,))
    return self._fns[key]

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """See `Engine.generate`; returns `[P][n]` completions."""
    if self._closed:
      raise RuntimeError("JaxSampler is closed")
    prompts = validate_prompts(prompt_token_ids, self.vocab_size)
    if any(t >= self.vocab_size for t in params.stop_token_ids):
      raise ValueError(f"SamplingParams.stop_token_ids {params.stop_token_ids} outside the "
                       f"vocabulary of size {self.vocab_size}")
    if not prompts:
      return []
    n = params.n
    # One row per (prompt, sample), prompt-major.
    rows = [(p, j) for p in range(len(prompts)) for j in range(n)]
    stop_mask = np.zeros((self.vocab_size,), bool)
    stop_mask[list(params.stop_token_ids)] = True
    num_new = _bucket(params.max_tokens, self.min_new_bucket)
    scalars = (jnp.int32(params.max_tokens), jnp.float32(params.temperature),
               jnp.int32(params.top_k), jnp.float32(params.top_p), jnp.asarray(stop_mask))
    layout = self.layout_of(len(rows), max(len(p) for p in prompts), params.max_tokens)
    run = self._generate_ragged if layout == "ragged" else self._generate_dense
    flat = run(prompts, rows, params, num_new, scalars)
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

  def layout_of(self, num_rows: int, longest_prompt: int, max_tokens: int) -> str:
    """The path a request of ``num_rows`` rows, prompts of at most ``longest_prompt`` tokens and
    ``max_tokens`` new ones runs on: 'ragged' or 'dense'."""
    if self.cache_layout != "auto":
      return self.cache_layout
    length = (_bucket(longest_prompt, self.min_prompt_bucket)
              + _bucket(max_tokens, self.min_new_bucket))
    fits = num_rows <= self.max_batch_size and length <= self.decode_block
    return "dense" if fits else "ragged"

  def _keys(self, rows: Sequence[tuple[int, int]], size: int, params: SamplingParams):
    """`[size, 2]` keys of ``rows`` (the rest padding)."""
    pad = [0] * (size - len(rows))
    p_idx = np.array([p + params.prompt_index_offset for p, _ in rows] + pad, np.int32)
    j_idx = np.array([j for _, j in rows] + pad, np.int32)
    return row_keys(jnp.uint32(params.seed % (1 << 32)), p_idx, j_idx)

  def _generate_dense(self, prompts, rows, params, num_new, scalars) -> list[Completion]:
    """The reference path: chunks of ``max_batch_size`` rows, each to its longest row."""
    n, flat = params.n, []
    for start in range(0, len(rows), self.max_batch_size):
      chunk = rows[start:start + self.max_batch_size]
      batch = _bucket(len(chunk), self.min_batch_bucket)
      # The n rows of a prompt share one prefill when the chunk holds whole groups.
      group = n if n > 1 and start % n == 0 and len(chunk) % n == 0 and batch % n == 0 else 1
      prompt_len = _bucket(max(len(prompts[p]) for p, _ in chunk), self.min_prompt_bucket)
      ids, mask = _left_pad([prompts[p] for p, _ in chunk[::group]], batch // group, prompt_len)
      active = np.arange(batch) < len(chunk)
      out = self._fn(("dense", num_new, group))(
          self._state, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(active),
          self._keys(chunk, batch, params), *scalars)
      self.last_num_steps = int(out[5])
      flat += _completions(out, len(chunk), params.return_raw_logprobs)
    return flat

  def ragged_plan(self, num_rows: int, n: int, longest_prompt: int, max_tokens: int
                   ) -> tuple[tuple, int, int, int]:
    """(program key, slots, padded rows, padded prompt length) of a ragged call."""
    num_new = _bucket(max_tokens, self.min_new_bucket)
    slots = _bucket(min(num_rows, self.max_batch_size), self.min_batch_bucket)
    unit = continuous.admission_rows(slots, n)
    # Rows padded to a power of two >= the smallest batch, then to whole admissions.
    size = -(-_bucket(num_rows, max(unit, self.min_batch_bucket)) // unit) * unit
    prompt_len = _bucket(longest_prompt, self.min_prompt_bucket)
    block = min(self.decode_block, prompt_len, num_new)
    return ("ragged", num_new, unit, math.gcd(unit, n), block), slots, size, prompt_len

  def _generate_ragged(self, prompts, rows, params, num_new, scalars) -> list[Completion]:
    """All rows in one call on the ragged cache's slots (`continuous.generate`)."""
    key, slots, size, prompt_len = self.ragged_plan(len(rows), params.n,
                                                     max(len(p) for p in prompts),
                                                     params.max_tokens)
    ids, mask = _left_pad(prompts, _bucket(len(prompts), self.min_batch_bucket), prompt_len)
    row_prompt = np.zeros((size,), np.int32)
    row_prompt[:len(rows)] = [p for p, _ in rows]
    cache = continuous.empty_cache(self.model.config, slots, prompt_len + num_new,
                                   self.cache_dtype)
    out = self._fn(key)(self._state, cache, jnp.asarray(ids), jnp.asarray(mask),
                        jnp.asarray(row_prompt), jnp.int32(len(rows)),
                        self._keys(rows, size, params), *scalars)
    self.last_num_steps = int(out[5])
    return _completions(out, len(rows), params.return_raw_logprobs)

  def lower_programs(self, prompts: int, n: int, prompt_len: int, max_tokens: int, *,
                     sharding: Any = None, programs: Sequence[str] = PROGRAMS
                     ) -> dict[str, jax.stages.Lowered]:
    """The ragged path's programs for a request of ``prompts`` prompts of ``prompt_len`` tokens x
    ``n`` samples x ``max_tokens``, lowered on abstract inputs (nothing allocated; the model may
    be abstract too: `nnx.eval_shape`), placed by ``sharding`` (e.g. on the abstract devices of
    `disa_jax.parallel.gpu_compile`; None: the default device).

    Returns:
      ``programs`` of `PROGRAMS`, lowered: 'generate' (the whole call, `continuous.generate`),
      'prefill' (one admission of its loop, `continuous.prefill_step`) and 'decode' (one decode
      step of every slot, `continuous.decode_step`): the jitted functions the call runs, or its
      loop's body parts, with the cache (or the loop carry holding it) donated.

    Raises:
      ValueError: the sampler runs such a request on the dense path (`layout_of`).
    """
    bad = [p for p in programs if p not in PROGRAMS]
    if bad:
      raise ValueError(f"JaxSampler.lower_programs programs {bad}: expected some of {PROGRAMS}")
    if self.layout_of(prompts * n, prompt_len, max_tokens) != "ragged":
      raise ValueError(
          f"JaxSampler.lower_programs: a request of {prompts} x {n} rows, prompt_len {prompt_len}, "
          f"max_tokens {max_tokens} runs on the dense path with cache_layout="
          f"{self.cache_layout!r}; these are the ragged path's programs (cache_layout='ragged')")
    key, slots, size, padded = self.ragged_plan(prompts * n, n, prompt_len, max_tokens)
    _, num_new, unit, group, block = key
    dtype = self.cache_dtype.name
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    cache = jax.tree.map(shape, jax.eval_shape(lambda: continuous.empty_cache(
        self.model.config, slots, padded + num_new, self.cache_dtype)))
    state = jax.tree.map(shape, self._state)
    r = continuous.abstract_request(prompts=_bucket(prompts, self.min_batch_bucket),
                                    prompt_len=padded, rows=size, vocab=self.vocab_size,
                                    sharding=sharding)
    loop = jax.tree.map(shape, jax.eval_shape(
        functools.partial(continuous.init_loop, rows=size, num_new=num_new), cache))
    lowered = {}
    for name in programs:
      if name == "generate":
        lowered[name] = self._fn(key).lower(state, cache, r.prompt_ids, r.prompt_mask,
                                            r.row_prompt, r.num_rows, r.keys, r.max_new,
                                            *r.sampling, r.stop_mask)
      else:
        step = (functools.partial(continuous.prefill_step, unit=unit, group=group)
                if name == "prefill" else functools.partial(continuous.decode_step, block=block))
        lowered[name] = jax.jit(functools.partial(step, self._graphdef, cache_dtype=dtype),
                                donate_argnums=(1,)).lower(state, loop, r)
    return lowered

  def compiled_memory(self, prompts: int, n: int, prompt_len: int, max_tokens: int) -> Any:
    """The ragged program of a request (`lower_programs`' 'generate'), compiled for the default
    backend.

    Returns:
      (`jax.stages.Compiled.memory_analysis()`, the KV cache's bytes).
    """
    lowered = self.lower_programs(prompts, n, prompt_len, max_tokens, programs=("generate",))
    _, slots, _, padded = self.ragged_plan(prompts * n, n, prompt_len, max_tokens)
    num_new = _bucket(max_tokens, self.min_new_bucket)
    return lowered["generate"].compile().memory_analysis(), continuous.cache_bytes(
        self.model.config, slots, padded + num_new, self.cache_dtype)

  def load_params(self, source: models.Transformer, dtype: Any = None) -> None:
    """The weights of ``source``, a model of this process (the trainer's policy), copied on the
    devices (`flat_weights.copy_into`: the values a flat push of ``dtype`` gives, without its host
    copies); prepared once per source and dtype (`flat_weights.DeviceCopy`). Waits for them."""
    if self._copy is None or self._copy[0] is not source or self._copy[1] != dtype:
      self._copy = (source, dtype, flat_weights.DeviceCopy(self.model, source, dtype))
    self._state = jax.block_until_ready(self._copy[2](source, self._state))
    nnx.update(self.model, self._state)

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    """Loads HF-named, HF-layout weights (every key used, every shape checked), or a flat push
    (`flat_weights.FlatWeights`: its buckets straight into the model's own layouts)."""
    self._copy = None  # (its placements are read again at the next `load_params`)
    if isinstance(state_dict, flat_weights.FlatWeights):
      flat_weights.load_into(self.model, state_dict)
    else:
      models.load_hf_state_dict(self.model, state_dict)
    # Transfers are asynchronous: wait, so that the caller may reuse the host arrays (the
    # generation process's shared block) and the sync's load time counts the copy to the device.
    self._state = jax.block_until_ready(_committed(nnx.state(self.model)))

  def close(self) -> None:
    self._closed = True
    self._fns.clear()

  def __enter__(self) -> "JaxSampler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
