"""The JAX sampler: the default rollout engine, on `Transformer`'s KV-cache API.

One jitted function per shape bucket runs the prefill and the whole decode loop (`lax.while_loop`,
which exits as soon as every sequence has emitted a stop token). The n samples of a prompt share
one prefill: the prompt runs once and its KV cache is repeated to its n rows. Prompts are
left-padded; the batch size, the padded prompt length and the number of new tokens are rounded up
to powers of two, and the sampling parameters (temperature, top-k, top-p, stop tokens,
max_tokens) are traced values, so new prompt lengths or parameters do not recompile.

Randomness: each sample (prompt p, sample j) draws from its own key `fold_in(fold_in(key(seed), p),
j)`, folded with the step index, so a sample does not depend on what else is in the batch.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax import models
from disa_jax.rollout.types import Completion, SamplingParams, validate_prompts

_NEG_INF = -jnp.inf


def _bucket(n: int, minimum: int) -> int:
  """Smallest power of two >= max(n, minimum)."""
  return 1 << max(int(n - 1).bit_length(), int(minimum - 1).bit_length())


def process_logits(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                   top_p: jax.Array) -> jax.Array:
  """Log-probs of the distribution actually sampled from.

  Scales by the temperature, keeps the `top_k` largest logits (0 = all), then the smallest set of
  most likely tokens whose probability reaches `top_p` (a token is kept if the mass of the tokens
  ranked above it is < top_p; the most likely token is always kept). Ties at a cut-off are kept.

  Args:
    logits: `[B, V]` float32 raw logits.
    temperature: scalar > 0 (callers substitute 1 for greedy).
    top_k: int32 scalar, 0 = off.
    top_p: float32 scalar in (0, 1].

  Returns:
    `[B, V]` float32 log-probs; -inf outside the kept set.
  """
  vocab = logits.shape[-1]
  scaled = logits.astype(jnp.float32) / temperature

  def truncate(scaled):
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jax.lax.dynamic_index_in_dim(sorted_desc, k - 1, axis=-1, keepdims=True)  # [B, 1]
    sorted_desc = jnp.where(sorted_desc >= kth, sorted_desc, _NEG_INF)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # [B, V]
    # Tokens cut by top-k have probability 0 but their mass_above may round below 1.
    keep = (mass_above < top_p) & (sorted_desc > _NEG_INF)
    cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
    return jnp.where(scaled >= cutoff, scaled, _NEG_INF)

  scaled = jax.lax.cond((top_k > 0) | (top_p < 1.0), truncate, lambda s: s, scaled)
  return jax.nn.log_softmax(scaled, axis=-1)


def _sample_step(logits: jax.Array, keys: jax.Array, step: jax.Array, temperature: jax.Array,
                 top_k: jax.Array, top_p: jax.Array):
  """Samples one token per row.

  Args:
    logits: `[B, V]` raw logits.
    keys: `[B, 2]` uint32 per-row keys.
    step: int32 scalar, folded into the keys.

  Returns:
    (tokens `[B]` int32, processed log-probs `[B]` (0 for greedy), raw log-probs `[B]`).
  """
  logits = logits.astype(jnp.float32)
  greedy = temperature <= 0.0
  processed = process_logits(logits, jnp.where(greedy, 1.0, temperature), top_k, top_p)
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, step)
  sampled = jax.vmap(jax.random.categorical)(step_keys, processed)  # [B]
  tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
  lp = jnp.take_along_axis(processed, tokens[:, None], axis=-1)[:, 0]
  raw = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
  return tokens, jnp.where(greedy, 0.0, lp), raw


def _generate_impl(graphdef, state, input_ids, prompt_mask, active, keys, max_new, temperature,
                   top_k, top_p, stop_mask, *, num_new: int, cache_dtype: Any, group: int = 1):
  """Prefill + decode loop for one bucket.

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
  positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0).astype(jnp.int32)
  # Left padding: the last column holds every row's last prompt token.
  logits, cache = model.forward_with_cache(input_ids, positions, cache, jnp.int32(0), kv_mask,
                                           last_only=True)
  if group > 1:  # [B / g, ...] -> [B, ...]: each prompt's state for its g samples
    logits, kv_mask, prompt_mask = (jnp.repeat(x, group, axis=0)
                                    for x in (logits, kv_mask, prompt_mask))
    cache = {k: jnp.repeat(v, group, axis=1) for k, v in cache.items()}  # [L, B, S, K, H]
  tok, lp, raw = _sample_step(logits[:, -1], keys, jnp.int32(0), temperature, top_k, top_p)
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
    new_tok, lp, raw = _sample_step(logits[:, 0], keys, step, temperature, top_k, top_p)
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


@jax.jit
def _row_keys(seed: jax.Array, prompt_idx: jax.Array, sample_idx: jax.Array) -> jax.Array:
  """`[B, 2]` keys fold_in(fold_in(PRNGKey(seed), p), j)."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda p, j: jax.random.fold_in(jax.random.fold_in(base, p), j))(
      prompt_idx, sample_idx)


class JaxSampler:
  """Samples from a `disa_jax.models.Transformer` in this process; implements `Engine`.

  Args:
    model: the model (its weights are updated in place by `update_weights`).
    max_batch_size: rows (prompts x n) per jitted call; larger requests are split.
    min_batch_bucket: smallest padded batch (fewer distinct shapes to compile).
    min_prompt_bucket: smallest padded prompt length.
    min_new_bucket: smallest output buffer length.
    cache_dtype: KV-cache dtype (default: the model's computation dtype).
  """

  def __init__(self, model: models.Transformer, *, max_batch_size: int = 256,
               min_batch_bucket: int = 8, min_prompt_bucket: int = 16, min_new_bucket: int = 16,
               cache_dtype: Any = None):
    if max_batch_size < 1:
      raise ValueError(f"JaxSampler.max_batch_size must be >= 1, got {max_batch_size}")
    self.model = model
    self.vocab_size = model.config.vocab_size
    self.max_batch_size = max_batch_size
    self.min_batch_bucket = min_batch_bucket
    self.min_prompt_bucket = min_prompt_bucket
    self.min_new_bucket = min_new_bucket
    self.cache_dtype = jnp.dtype(cache_dtype or model.dtype)
    self._graphdef, self._state = nnx.split(model)
    self._fns: dict[int, Any] = {}
    self._closed = False
    self.last_num_steps = 0  # decoding steps of the last jitted call (for tests and stats)

  @classmethod
  def from_pretrained(cls, model_path: str, *, dtype: str = "float32",
                      **kwargs: Any) -> "JaxSampler":
    """Loads a local HF checkpoint with `disa_jax.models.from_pretrained`."""
    return cls(models.from_pretrained(model_path, dtype=jnp.dtype(dtype)), **kwargs)

  def _fn(self, num_new: int, group: int):
    if (num_new, group) not in self._fns:
      self._fns[num_new, group] = jax.jit(functools.partial(
          _generate_impl, self._graphdef, num_new=num_new, cache_dtype=self.cache_dtype,
          group=group))
    return self._fns[num_new, group]

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """See `Engine.generate`; returns `[P][n]` completions."""
    if self._closed:
      raise RuntimeError("JaxSampler is closed")
    prompts = validate_prompts(prompt_token_ids, self.vocab_size)
    if any(t >= self.vocab_size for t in params.stop_token_ids):
      raise ValueError(f"SamplingParams.stop_token_ids {params.stop_token_ids} outside the "
                       f"vocabulary of size {self.vocab_size}")
    n = params.n
    # One row per (prompt, sample), prompt-major.
    rows = [(p, j) for p in range(len(prompts)) for j in range(n)]
    stop_mask = np.zeros((self.vocab_size,), bool)
    stop_mask[list(params.stop_token_ids)] = True
    num_new = _bucket(params.max_tokens, self.min_new_bucket)
    scalars = (jnp.int32(params.max_tokens), jnp.float32(params.temperature),
               jnp.int32(params.top_k), jnp.float32(params.top_p), jnp.asarray(stop_mask))
    flat: list[Completion] = []
    for start in range(0, len(rows), self.max_batch_size):
      chunk = rows[start:start + self.max_batch_size]
      batch = _bucket(len(chunk), self.min_batch_bucket)
      # The n rows of a prompt share one prefill when the chunk holds whole groups.
      group = n if n > 1 and start % n == 0 and len(chunk) % n == 0 and batch % n == 0 else 1
      prompt_len = _bucket(max(len(prompts[p]) for p, _ in chunk), self.min_prompt_bucket)
      ids = np.zeros((batch // group, prompt_len), np.int32)
      mask = np.zeros((batch // group, prompt_len), np.int32)
      for r, (p, _) in enumerate(chunk[::group]):
        ids[r, prompt_len - len(prompts[p]):] = prompts[p]
        mask[r, prompt_len - len(prompts[p]):] = 1
      mask[len(chunk) // group:, -1] = 1  # padding rows hold one dummy token
      active = np.arange(batch) < len(chunk)
      p_idx = np.array([p + params.prompt_index_offset for p, _ in chunk]
                       + [0] * (batch - len(chunk)), np.int32)
      j_idx = np.array([j for _, j in chunk] + [0] * (batch - len(chunk)), np.int32)
      keys = _row_keys(jnp.uint32(params.seed % (1 << 32)), p_idx, j_idx)
      out = self._fn(num_new, group)(self._state, jnp.asarray(ids), jnp.asarray(mask),
                              jnp.asarray(active), keys, *scalars)
      tok, lp, raw, lengths, stopped, steps = (np.asarray(x) for x in out)
      self.last_num_steps = int(steps)
      for r in range(len(chunk)):
        k = int(lengths[r])
        flat.append(Completion(
            token_ids=tok[r, :k], logprobs=lp[r, :k],
            raw_logprobs=raw[r, :k] if params.return_raw_logprobs else None,
            finish_reason="stop" if stopped[r] else "length"))
    return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    """Loads HF-named, HF-layout weights (every key used, every shape checked)."""
    models.load_hf_state_dict(self.model, state_dict)
    # Transfers are asynchronous: wait, so that the caller may reuse the host arrays (the
    # generation process's shared block) and the sync's load time counts the copy to the device.
    self._state = jax.block_until_ready(nnx.state(self.model))

  def close(self) -> None:
    self._closed = True
    self._fns.clear()

  def __enter__(self) -> "JaxSampler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
