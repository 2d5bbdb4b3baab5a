"""Empty inputs to the JAX sampler: no prompts give no completions, and nothing is compiled."""
import numpy as np

from disa_jax.rollout import SamplingParams
from disa_jax.rollout.jax_sampler import JaxSampler


def test_generate_with_no_prompts_returns_an_empty_list(tiny_model):
  sampler = JaxSampler(tiny_model)
  params = SamplingParams(n=3, max_tokens=4, seed=1)
  assert sampler.generate([], params) == []
  assert sampler._fns == {}  # pylint: disable=protected-access  # nothing was traced or compiled
  out = sampler.generate([[5, 6, 7]], params)  # and the sampler still works afterwards
  assert len(out) == 1 and len(out[0]) == 3
  assert all(1 <= c.token_ids.size <= 4 and np.isfinite(c.logprobs).all() for c in out[0])
