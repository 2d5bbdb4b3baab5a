import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.anchor.embeddings import embed_prompts
from disa_jax.scoring import prompt_embeddings
from disa_jax.testing import make_tiny_model


@pytest.mark.slow
def test_embed_prompts_matches_unpadded_mean_pool():
  model = make_tiny_model("qwen3", seed=0)
  prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
  emb, spec = embed_prompts(model, prompts, pad_id=0, batch_size=2, pad_to=4, model_path="m")
  assert emb.shape == (3, model.config.hidden_size) and spec.dim == model.config.hidden_size
  assert spec.source == "model_mean_pool" and spec.model_path == "m"
  for i, p in enumerate(prompts):  # each prompt alone, no padding at all
    ids = jnp.asarray([p])
    ref = np.asarray(prompt_embeddings(model, ids, jnp.ones_like(ids)))[0]
    np.testing.assert_allclose(emb[i], ref, rtol=2e-5, atol=2e-5)
