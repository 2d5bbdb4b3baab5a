import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.scoring import token_logprobs
from disa_jax.scoring.batched import SequenceScorer
from disa_jax.testing import make_tiny_model


@pytest.mark.slow
def test_scorer_matches_unpadded_scoring_and_updates():
  model = make_tiny_model("qwen3", seed=0)
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
  responses = [[20, 21], [22, 23, 24, 25], [26], []]
  scorer = SequenceScorer(model, pad_id=0, batch_size=3, pad_to=4)
  per_tok = scorer.token_logprobs(prompts, responses)
  seq = scorer.sequence_logprobs(prompts, responses)
  for i, (p, r) in enumerate(zip(prompts, responses)):
    ids = jnp.asarray([p + r])
    ref = np.asarray(token_logprobs(model, ids, jnp.ones_like(ids)))[0, len(p):]
    np.testing.assert_allclose(per_tok[i], ref, rtol=1e-5, atol=1e-5)
    assert seq[i] == np.float64(ref.sum()) or abs(seq[i] - ref.sum()) < 1e-4
  assert per_tok[3].shape == (0,) and seq[3] == 0.0
  other = make_tiny_model("qwen3", seed=1)
  scorer.update(other)
  ids = jnp.asarray([prompts[0] + responses[0]])
  ref = np.asarray(token_logprobs(other, ids, jnp.ones_like(ids)))[0, 3:]
  np.testing.assert_allclose(scorer.token_logprobs(prompts[:1], responses[:1])[0], ref, rtol=1e-5, atol=1e-5)
