"""Stage 2: the regressor recovers a known function, refuses bad labels, freezes and round-trips."""
import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disa_jax.anchor import Anchor, AnchorFitConfig, EmbeddingSpec, fit_anchor
from disa_jax.estimators import RewardTransform

RT = RewardTransform(kind="group_zscore")


def _data(p=3000, d=8, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(p, d)).astype(np.float32)
  y = 2.0 + np.sin(1.5 * x[:, 0]) + 0.5 * x[:, 1] - 0.3 * x[:, 2] ** 2  # smooth, non-linear
  return x, y


@pytest.fixture(scope="module")
def fitted():
  x, y = _data()
  return x, y, fit_anchor(x, y, beta=15.0, reward_transform=RT, label_scale="mean",
                          config=AnchorFitConfig(epochs=80, batch_size=64, val_fraction=0.2, seed=1))


def test_recovers_smooth_function(fitted):
  x, y, res = fitted
  s = res.summary()
  assert s["val_r2"] >= 0.95, s
  assert len(res.history["val_mse"]) == 80 and s["best_epoch"] == int(np.argmin(res.history["val_mse"]))
  assert res.history["val_mse"][-1] < res.history["val_mse"][0]
  # fresh held-out points from the same function
  xt, yt = _data(500, seed=123)
  pred = np.asarray(res.anchor(xt))
  r2 = 1 - np.mean((pred - yt) ** 2) / np.var(yt)
  assert r2 >= 0.95, r2


def test_anchor_is_frozen_no_gradient_reaches_psi(fitted):
  x, _, res = fitted
  anchor = res.anchor
  xs = jnp.asarray(x[:4])

  def through_call(state):
    """sum(anchor(x)) as a function of psi, through the public `__call__`."""
    twin = copy.copy(anchor)
    twin._state = state  # pylint: disable=protected-access
    return jnp.sum(twin(xs))

  def unfrozen(state):  # positive control: the same MLP, called without the anchor's wrapper
    return jnp.sum(nnx.merge(anchor._graphdef, state)(xs))  # pylint: disable=protected-access

  for grad in (jax.grad, lambda f: jax.jit(jax.grad(f))):
    leaves = jax.tree.leaves(grad(through_call)(anchor.state))
    assert leaves and all(float(jnp.abs(g).max()) == 0.0 for g in leaves)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(jax.grad(unfrozen)(anchor.state))) > 0
  np.testing.assert_allclose(float(through_call(anchor.state)), float(unfrozen(anchor.state)),
                             rtol=1e-5)  # same values: only the gradient is cut
  g_x = jax.grad(lambda e: jnp.sum(anchor(e)))(xs)
  assert float(jnp.abs(g_x).max()) == 0.0  # stop_gradient on the output too


def test_rejects_nan_and_inf_labels_with_indices():
  x, y = _data(100)
  y = y.copy()
  y[[3, 17]] = [np.nan, -np.inf]
  with pytest.raises(ValueError, match=r"index\(es\) \[3, 17\]"):
    fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum")
  with pytest.raises(ValueError, match="labels must be"):
    fit_anchor(x, y[:50], beta=1.0, reward_transform=RT, label_scale="sum")
  with pytest.raises(ValueError, match="learning_rate"):
    AnchorFitConfig(learning_rate=0.0)


def test_weighted_least_squares_follows_weights():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(400, 2)).astype(np.float32)
  y = np.where(np.arange(400) % 2 == 0, 1.0, 5.0)  # two labels for the same x distribution
  w = np.where(np.arange(400) % 2 == 0, 1.0, 0.0)  # weight only the first group
  res = fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", sample_weights=w,
                   config=AnchorFitConfig(epochs=60, batch_size=64, val_fraction=0.0))
  assert abs(float(np.mean(res.anchor(x))) - 1.0) < 0.5


def test_save_load_roundtrip_and_compatibility(fitted, tmp_path):
  x, _, res = fitted
  res.anchor.save(tmp_path / "anchor")
  loaded = Anchor.load(tmp_path / "anchor")
  np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(res.anchor(x)))
  assert loaded.meta == res.anchor.meta
  loaded.check_compatible(beta=15.0, reward_transform=RT, label_scale="mean", embedding_dim=8)
  with pytest.raises(ValueError, match="beta"):
    loaded.check_compatible(beta=10.0, reward_transform=RT, label_scale="mean")
  with pytest.raises(ValueError, match="label_scale"):
    loaded.check_compatible(beta=15.0, reward_transform=RT, label_scale="sum")
  with pytest.raises(ValueError, match="reward transform mismatch"):
    loaded.check_compatible(beta=15.0, reward_transform=RewardTransform(), label_scale="mean")
  with pytest.raises(ValueError, match="embeddings of shape"):
    loaded(np.zeros((2, 3), np.float32))
  with pytest.raises(FileExistsError):
    res.anchor.save(tmp_path / "anchor")
  with pytest.raises(ValueError, match="source"):
    EmbeddingSpec(source="tfidf", dim=3)


def _small_anchor(spec):
  x, y = _data(64, d=spec.dim)
  return fit_anchor(x, y, beta=15.0, reward_transform=RT, label_scale="sum", embedding=spec,
                    config=AnchorFitConfig(epochs=2, batch_size=32, val_fraction=0.0)).anchor


def test_check_compatible_reference_model_and_rendering(tmp_path):
  ref = tmp_path / "models" / "qwen3-4b-base"
  ref.mkdir(parents=True)
  os.symlink(ref, tmp_path / "link_to_ref")
  spec = EmbeddingSpec(source="model_mean_pool", dim=8, model_path=str(ref),
                       rendering="chat_template")
  _small_anchor(spec).save(tmp_path / "anchor")
  anchor = Anchor.load(tmp_path / "anchor")
  assert anchor.meta.embedding == spec
  ok = dict(beta=15.0, reward_transform=RT, label_scale="sum")
  anchor.check_compatible(**ok, reference=str(ref), rendering="chat_template")
  anchor.check_compatible(**ok, reference=str(ref) + "/")  # the same directory, spelled otherwise
  anchor.check_compatible(**ok, reference=str(tmp_path / "link_to_ref"))
  anchor.check_compatible(**ok)  # nothing to compare when the run does not say
  other = str(tmp_path / "models" / "qwen3-8b-base")
  with pytest.raises(ValueError, match=rf"reference model '{ref}' \(EmbeddingSpec.model_path\), "
                                       rf"but the run's reference is '{other}'"):
    anchor.check_compatible(**ok, reference=other)
  with pytest.raises(ValueError, match=r"prompts rendered as 'chat_template' .* but the run renders "
                                       r"them as 'plain'"):
    anchor.check_compatible(**ok, rendering="plain")
  with pytest.raises(ValueError, match=r"rendering must be one of \('chat_template', 'plain'\), "
                                       r"got 'raw'"):
    anchor.check_compatible(**ok, rendering="raw")
  with pytest.raises(ValueError, match=r"EmbeddingSpec.rendering must be one of"):
    EmbeddingSpec(dim=3, rendering="jinja")
  bare = _small_anchor(EmbeddingSpec(source="precomputed", dim=8))  # no model recorded
  with pytest.raises(ValueError, match=rf"reference model None .* reference is '{ref}'"):
    bare.check_compatible(**ok, reference=str(ref))


def test_anchor_metadata_without_rendering_loads(tmp_path):
  spec = EmbeddingSpec(source="model_mean_pool", dim=8, model_path="/models/ref",
                       prompt_format="stage1_prompt_text", rendering="plain")
  saved = _small_anchor(spec)
  saved.save(tmp_path / "old")
  meta_path = tmp_path / "old" / "anchor_meta.json"
  meta = json.loads(meta_path.read_text())
  del meta["embedding"]["rendering"]  # as written before the field existed
  meta_path.write_text(json.dumps(meta))
  old = Anchor.load(tmp_path / "old")
  assert old.meta.embedding.rendering is None and old.meta.embedding.model_path == "/models/ref"
  x, _ = _data(5, d=8)
  np.testing.assert_array_equal(np.asarray(old(x)), np.asarray(saved(x)))
  ok = dict(beta=15.0, reward_transform=RT, label_scale="sum")
  old.check_compatible(**ok, reference="/models/ref")
  with pytest.raises(ValueError, match=r"rendered as None \(EmbeddingSpec.rendering; None: not "
                                       r"recorded .* renders them as 'plain'"):
    old.check_compatible(**ok, rendering="plain")


def test_save_replaces_what_an_interrupted_save_left(tmp_path):
  """Weights without anchor_meta.json (a save killed before its last write) are replaced."""
  anchor = _small_anchor(EmbeddingSpec(source="model_mean_pool", dim=8, model_path="/m"))
  anchor.save(tmp_path / "a")
  (tmp_path / "a" / "anchor_meta.json").unlink()  # as a kill between the two writes leaves it
  (tmp_path / "a" / "anchor_meta.json.tmp").write_text("{")
  with pytest.raises(FileNotFoundError, match="not an anchor directory"):
    Anchor.load(tmp_path / "a")
  with pytest.warns(UserWarning, match=r"removing \['anchor_meta.json.tmp', 'state'\] left by an "
                                       r"anchor save that did not finish"):
    anchor.save(tmp_path / "a")
  x, _ = _data(5, d=8)
  np.testing.assert_array_equal(np.asarray(Anchor.load(tmp_path / "a")(x)), np.asarray(anchor(x)))
  with pytest.raises(FileExistsError, match=r"already holds an anchor \(anchor_meta.json\)"):
    anchor.save(tmp_path / "a")
