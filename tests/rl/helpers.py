"""Shared helpers for the Stage 3 tests: a reference log-prob function and synthetic batches."""
import jax
import jax.numpy as jnp
import numpy as np

from disa_jax.rl.batch import TrainBatch


def naive_token_logprobs(model, input_ids, attention_mask):
  """out[:, t] = log p(ids[t] | ids[<t]) from full float32 logits (reference implementation)."""
  logits = model(input_ids, attention_mask=attention_mask).astype(jnp.float32)  # [B, T, V]
  lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # predicts tokens 1..T-1
  tok = jnp.take_along_axis(lp, input_ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
  valid = (attention_mask[:, 1:] > 0) & (attention_mask[:, :-1] > 0)
  tok = jnp.where(valid, tok, 0.0)
  return jnp.pad(tok, ((0, 0), (1, 0)))  # [B, T], zero at t = 0


def synthetic_batch(seed, rows, width, prompt_len, vocab, group_size=4, invalid_rows=0):
  """A right-padded prompt+response `TrainBatch` with made-up log-probs and signals (numpy)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, vocab, (rows, width)).astype(np.int32)
  resp_len = rng.integers(1, width - prompt_len + 1, rows)
  pos = np.arange(width)[None]
  attn = (pos < prompt_len + resp_len[:, None]).astype(np.int32)
  prompt_mask = np.broadcast_to(pos < prompt_len, (rows, width)).astype(np.float32)
  resp_mask = ((pos >= prompt_len) & (attn > 0)).astype(np.float32)
  if invalid_rows:
    resp_mask[-invalid_rows:] = 0.0
  ids = np.where(attn > 0, ids, 0).astype(np.int32)
  old = (-rng.uniform(3.5, 5.5, (rows, width)) * resp_mask).astype(np.float32)
  ref = (-rng.uniform(3.5, 5.5, (rows, width)) * resp_mask).astype(np.float32)
  reward = rng.integers(0, 2, rows).astype(np.float32)
  grouped = reward.reshape(-1, group_size)  # [B] -> [P, G]
  adv = ((grouped - grouped.mean(-1, keepdims=True)) /
         (grouped.std(-1, keepdims=True) + 1e-6)).reshape(-1)  # [P, G] -> [B]
  log_z = np.repeat(rng.normal(-4.0, 1.0, rows // group_size), group_size).astype(np.float32)
  return TrainBatch(input_ids=ids, attention_mask=attn, prompt_mask=prompt_mask,
                    response_mask=resp_mask, old_logp=old, ref_logp=ref,
                    signal=adv.astype(np.float32), log_z=log_z)
