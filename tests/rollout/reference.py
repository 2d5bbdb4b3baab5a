"""NumPy reference of the sampled distribution and teacher-forced log-probs, for rollout tests."""

import functools
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax import models, scoring
from disa_jax.rollout import flat_weights

PAD_TO = 64  # sequences are right-padded to this length so that one compiled forward serves all


@nnx.jit
def _forward(model, ids):
  return model(ids).astype(jnp.float32)


def _logits(model, ids: np.ndarray) -> np.ndarray:
  """`[T, V]` logits of one sequence (right padding cannot change earlier causal positions)."""
  if len(ids) > PAD_TO:
    raise ValueError(f"sequence of length {len(ids)} exceeds PAD_TO={PAD_TO}")
  padded = np.zeros((1, PAD_TO), np.int32)
  padded[0, :len(ids)] = ids
  return np.asarray(_forward(model, jnp.asarray(padded)))[0, :len(ids)]


def processed_logprobs_np(logits: np.ndarray, temperature: float, top_k: int,
                          top_p: float) -> np.ndarray:
  """`[V]` float64 log-probs after temperature, top-k, top-p (-inf outside the kept set).

  Independent of the JAX implementation: a token is kept when it is among the k largest and the
  probability mass of the kept tokens ranked above it is < top_p.
  """
  s = logits.astype(np.float64) / temperature
  order = np.argsort(-s, kind="stable")
  kept = np.zeros(s.shape, bool)
  k = len(s) if top_k == 0 else min(top_k, len(s))
  top = order[:k]
  probs = np.exp(s[top] - s[top].max())
  probs /= probs.sum()
  mass_above = np.cumsum(probs) - probs
  kept[top[mass_above < top_p]] = True
  out = np.full(s.shape, -np.inf)
  z = s[kept].max()
  out[kept] = s[kept] - z - np.log(np.exp(s[kept] - z).sum())
  return out


def teacher_forced_logits(model, prompt, completion) -> np.ndarray:
  """`[L, V]` float32 logits predicting each completion token (one full forward, no cache)."""
  ids = np.concatenate([np.asarray(prompt), np.asarray(completion)]).astype(np.int32)
  return _logits(model, ids)[len(prompt) - 1:len(prompt) - 1 + len(completion)]


def next_token_logits(model, prompt) -> np.ndarray:
  """`[V]` float32 logits of the token after `prompt`."""
  return _logits(model, np.asarray(prompt, np.int32))[-1]


@nnx.jit
def _token_logprobs(model, ids, mask):
  return scoring.token_logprobs(model, ids, mask)


def raw_logprobs_ref(model, prompt, completion) -> np.ndarray:
  """`[L]` raw log-probs of the completion by `disa_jax.scoring.token_logprobs` (teacher forced)."""
  ids = np.concatenate([np.asarray(prompt), np.asarray(completion)]).astype(np.int32)
  if len(ids) > PAD_TO:
    raise ValueError(f"sequence of length {len(ids)} exceeds PAD_TO={PAD_TO}")
  padded = np.zeros((1, PAD_TO), np.int32)
  padded[0, :len(ids)] = ids
  mask = (np.arange(PAD_TO) < len(ids)).astype(np.int32)[None]
  out = np.asarray(_token_logprobs(model, jnp.asarray(padded), jnp.asarray(mask)))[0]
  return out[len(prompt):len(ids)]


def assert_same_completions(got, want, atol: float = 0.0) -> None:
  """`[P][n]` completions: the same tokens and finish reasons, log-probs (and raw log-probs where
  ``want`` has them) equal bit for bit, or within ``atol``."""
  close = (np.testing.assert_array_equal if atol == 0.0
           else functools.partial(np.testing.assert_allclose, atol=atol))
  for per_g, per_w in zip(got, want, strict=True):
    for g, w in zip(per_g, per_w, strict=True):
      np.testing.assert_array_equal(g.token_ids, w.token_ids)
      close(g.logprobs, w.logprobs)
      if w.raw_logprobs is not None:
        close(g.raw_logprobs, w.raw_logprobs)
      assert g.finish_reason == w.finish_reason


def flat_push(hf_state, config, bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES
              ) -> flat_weights.FlatWeights:
  """The flat push (float32, buckets of ``bucket_bytes``) of the HF-named weights ``hf_state`` of
  a model of ``config``."""
  model = models.Transformer(config, rngs=nnx.Rngs(0))
  models.load_hf_state_dict(model, hf_state)
  return flat_weights.export(model, "float32", bucket_bytes=bucket_bytes)


def check_update_changes_and_restores(engine, prompts, params, hf_state, seed: int,
                                      push=lambda state: state) -> None:
  """Perturbed weights change the samples; restoring the weights restores them bit for bit.

  ``push`` turns HF-named weights into what is pushed (e.g. `flat_push`)."""
  before = engine.generate(prompts, params)
  rng = np.random.default_rng(seed)
  perturbed = {k: v + 0.5 * v.std() * rng.standard_normal(v.shape).astype(v.dtype)
               for k, v in hf_state.items()}
  engine.update_weights(push(perturbed))
  during = engine.generate(prompts, params)
  engine.update_weights(push(hf_state))
  after = engine.generate(prompts, params)
  flat = lambda out: [c for per in out for c in per]
  assert any(not np.array_equal(a.token_ids, b.token_ids)
             for a, b in zip(flat(before), flat(during)))
  assert_same_completions(after, before)
