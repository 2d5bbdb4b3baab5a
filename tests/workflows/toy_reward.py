"""A task reward for the workflow tests: 1.0 when the response contains the ground-truth string.

Random tiny models never box a correct answer, so the math verifier gives all-zero rewards; this
reward (registered as 'toy_contains' on import, the way `reward_plugins` modules do) gives a mix.
"""
import numpy as np

from disa_jax import rewards


def toy_contains(responses, metas):
  """``[n]`` rewards of `disa_jax.rewards.Response` objects: 1.0 when the text holds the answer."""
  return np.asarray([1.0 if str(m["ground_truth"]) in r.text else 0.0
                     for r, m in zip(responses, metas)], np.float32)


if "toy_contains" not in rewards.reward_names():
  rewards.register_reward("toy_contains", toy_contains)
