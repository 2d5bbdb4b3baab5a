"""Parity of our decoders with `transformers` (torch, float32) for Qwen2, Qwen3 and Llama-3.

Checkpoints are made by `transformers` from tiny random configs and saved as safetensors; we load
them with `from_pretrained` and compare logits and per-layer hidden states; then our
`save_pretrained` output is loaded back by `transformers`.
"""

import numpy as np
import pytest
import torch
import transformers

import jax
import jax.numpy as jnp

from flax import nnx

from disa_jax import models, scoring

from .hf_utils import hf_forward, make_hf_model

FAMILIES = ("qwen2", "qwen3", "llama")
RNG = np.random.default_rng(0)
IDS = RNG.integers(0, 128, size=(2, 96)).astype(np.int32)  # 96 > the llama3 original context (64)


@pytest.fixture(scope="module", params=FAMILIES)
def hf_pair(request, tmp_path_factory):
  family = request.param
  hf = make_hf_model(family)
  path = str(tmp_path_factory.mktemp(f"hf_{family}"))
  hf.save_pretrained(path, safe_serialization=True)
  return family, hf, path


@pytest.mark.slow
def test_logits_and_hidden_states_float32(hf_pair):
  family, hf, path = hf_pair
  model = models.from_pretrained(path)
  ref_logits, ref_hidden = hf_forward(hf, IDS)
  logits = np.asarray(model(jnp.asarray(IDS)))
  assert np.abs(logits - ref_logits).max() <= 1e-4, family
  # HF hidden_states: embeddings, outputs of layers 1..L-1, final-normed output of layer L.
  layer_out = np.asarray(model.layer_outputs(jnp.asarray(IDS)))
  n_layers = model.config.num_layers
  for i in range(n_layers):
    assert np.abs(layer_out[i] - ref_hidden[i]).max() <= 1e-4, (family, i)
  final = np.asarray(model.hidden_states(jnp.asarray(IDS)))
  assert np.abs(final - ref_hidden[n_layers]).max() <= 1e-4, family


def test_left_padded_batch_matches_hf(hf_pair):
  family, hf, path = hf_pair
  model = models.from_pretrained(path)
  mask = np.ones_like(IDS)
  mask[0, :10] = 0  # left padding of the first row
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  ref_logits, _ = hf_forward(hf, IDS, attention_mask=mask, positions=positions)
  logits = np.asarray(model(jnp.asarray(IDS), attention_mask=jnp.asarray(mask)))
  real = mask.astype(bool)
  assert np.abs(logits[real] - ref_logits[real]).max() <= 1e-4, family


def test_gradients_float32(hf_pair):
  """Gradients of the mean token NLL, every weight, against torch autograd: the projections,
  RMSNorm and RoPE have hand-written backward passes (`layers.dense`, `layers.rms_norm`,
  `layers.apply_rope`), so a wrong transpose, sign or reduction there shows up here even when the
  logits agree. Compared in HF names and layouts, scaled by each tensor's largest entry."""
  family, hf, path = hf_pair
  ids, mask = IDS[:, :48], np.ones((2, 48), np.int32)
  mask[1, 40:] = 0  # a right-padded row
  logits = hf(input_ids=torch.tensor(ids, dtype=torch.long),
              attention_mask=torch.tensor(mask)).logits[:, :-1]
  logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[:, 1:, None], dtype=torch.long))
  w = torch.tensor(mask[:, 1:] * mask[:, :-1], dtype=torch.float32)
  hf.zero_grad()
  (-(logp[..., 0] * w).sum() / w.sum()).backward()
  want = {k: p.grad.numpy() for k, p in hf.named_parameters()}

  model = models.from_pretrained(path)
  graphdef, params = nnx.split(model)
  tokens, m = jnp.asarray(ids), jnp.asarray(mask)

  def loss(params):
    lp = scoring.token_logprobs(nnx.merge(graphdef, params), tokens, m)
    return -jnp.sum(lp) / jnp.sum(m[:, 1:] * m[:, :-1])

  got = models.to_hf_state_dict(nnx.merge(graphdef, jax.jit(jax.grad(loss))(params)))
  assert set(got) <= set(want), set(got) - set(want)
  for name, g in got.items():
    scale = max(np.abs(want[name]).max(), 1e-3)
    assert np.abs(g - want[name]).max() <= 1e-4 * scale, (family, name)


def test_bfloat16_within_documented_tolerance(hf_pair):
  """bf16: our error vs the float32 reference is at most 2x HF-bf16's own error (+1e-2)."""
  family, hf, path = hf_pair
  ref32, _ = hf_forward(hf, IDS)
  hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
  ref16, _ = hf_forward(hf16, IDS)
  ours16 = models.from_pretrained(path, dtype=jnp.bfloat16)
  logits16 = np.asarray(ours16(jnp.asarray(IDS)).astype(jnp.float32))
  hf_err = np.abs(ref16 - ref32).max()
  our_err = np.abs(logits16 - ref32).max()
  assert our_err <= 2 * hf_err + 1e-2, (family, our_err, hf_err)


def test_save_pretrained_round_trip_through_transformers(hf_pair, tmp_path):
  family, hf, path = hf_pair
  model = models.from_pretrained(path)
  out = models.save_pretrained(model, str(tmp_path / "ours"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  ref_logits, _ = hf_forward(hf, IDS)
  again, _ = hf_forward(reloaded, IDS)
  assert np.abs(again - ref_logits).max() <= 1e-6, family
  # and the HF state dict is bit-identical to the original
  ours_sd = models.to_hf_state_dict(model)
  hf_sd = {k: v.numpy() for k, v in hf.state_dict().items()}
  if model.config.tie_word_embeddings:
    hf_sd.pop("lm_head.weight", None)
  assert set(ours_sd) == set(hf_sd)
  for k in hf_sd:
    np.testing.assert_array_equal(ours_sd[k], hf_sd[k], err_msg=k)


def test_sharded_index_checkpoint_loads(hf_pair, tmp_path):
  family, hf, path = hf_pair
  sharded = str(tmp_path / "sharded")
  hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
  import os
  assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
  model = models.from_pretrained(sharded)
  ref_logits, _ = hf_forward(hf, IDS[:, :16])
  assert np.abs(np.asarray(model(jnp.asarray(IDS[:, :16]))) - ref_logits).max() <= 1e-4


def test_from_pretrained_with_mesh_places_shards(hf_pair):
  family, hf, path = hf_pair
  from disa_jax import parallel
  mesh = parallel.make_mesh(data=1, fsdp=4, tensor=2)
  model = models.from_pretrained(path, mesh=mesh, rules=parallel.TRAIN_RULES)
  q = model.layers.q_kernel[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
  assert q.addressable_shards[0].data.shape == (2, 16, 2, model.config.head_dim)
  ref_logits, _ = hf_forward(hf, IDS[:, :16])
  logits = jax.jit(lambda m, x: m(x))(model, jnp.asarray(IDS[:, :16]))
  assert np.abs(np.asarray(logits) - ref_logits).max() <= 1e-4
