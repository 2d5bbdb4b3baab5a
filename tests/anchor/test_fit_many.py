"""`fit_anchor_many` (vmapped Stage 2 fits for cross-validation), `fit_anchor` as its one-fit case, and Huber."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.anchor.fit import AnchorFitConfig, fit_anchor, fit_anchor_many, residual_loss
from disa_jax.estimators import RewardTransform

RT = RewardTransform(kind="raw")


def _data(p=30, d=5, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(p, d)).astype(np.float32)
  y = 2.0 * x[:, 0] + np.sin(x[:, 1]) + 0.1 * rng.normal(size=p)
  return x, y, rng.uniform(0.2, 3.0, size=p)


def _single(x, y, cfg, w=None, x_eval=None):
  res = fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", config=cfg, sample_weights=w)
  return np.asarray(res.anchor(x if x_eval is None else x_eval), np.float64)


def test_matches_fit_anchor_full_batch():
  # Full-batch epochs do not depend on the shuffling, so each vmapped fit is fit_anchor's fit exactly.
  x, y, w = _data()
  cfg = AnchorFitConfig(hidden_sizes=(16,), batch_size=64, epochs=40, val_fraction=0.0, seed=3)
  sub = np.arange(30) < 20
  ref_all = _single(x, y, cfg, w)
  ref_sub = _single(x[sub], y[sub], cfg, x_eval=x)
  pred = fit_anchor_many(x, np.stack([y, y + 1.0, y]), np.stack([np.ones(30, bool), np.ones(30, bool), sub]),
                         config=cfg, sample_weights=np.stack([w, w, np.ones(30)]))
  assert pred.shape == (3, 30)
  np.testing.assert_allclose(pred[0], ref_all, atol=1e-5)
  np.testing.assert_allclose(pred[1], ref_all + 1.0, atol=1e-5)  # label shift is absorbed by standardisation
  # trained on 20 rows, predicts all 30 (the other 10 are unseen); non-train labels may be NaN
  y_nan = np.where(sub, y, np.nan)
  pred_nan = fit_anchor_many(x, y_nan[None], sub[None], config=cfg)
  np.testing.assert_allclose(pred[2], ref_sub, atol=1e-5)
  np.testing.assert_allclose(pred_nan[0], ref_sub, atol=1e-5)


def test_minibatches_and_ragged_training_sets_learn():
  x, y, _ = _data(p=60)
  cfg = AnchorFitConfig(hidden_sizes=(32,), batch_size=8, epochs=60, val_fraction=0.0, seed=0)
  train = np.stack([np.arange(60) % 3 != k for k in range(3)] + [np.arange(60) < 47])  # 40, 40, 40, 47 rows
  pred = fit_anchor_many(x, np.tile(y, (4, 1)), train, config=cfg)
  for f in range(4):
    test = ~train[f]
    r2 = 1 - np.mean((pred[f, test] - y[test]) ** 2) / np.var(y[test])
    assert r2 > 0.8, (f, r2)
  single = _single(x[train[3]], y[train[3]], cfg)  # same recipe, different shuffles: similar train fit
  mse = lambda p: np.mean((p - y[train[3]]) ** 2)
  assert mse(pred[3][train[3]]) < 2.0 * mse(single) + 0.02


def test_bad_inputs():
  x, y, _ = _data()
  cfg = AnchorFitConfig(epochs=2)
  with pytest.raises(ValueError, match="train_mask"):
    fit_anchor_many(x, y[None], np.ones((1, 29), bool), config=cfg)
  with pytest.raises(ValueError, match="at least 2"):
    fit_anchor_many(x, y[None], (np.arange(30) < 1)[None], config=cfg)
  with pytest.raises(ValueError, match="non-finite"):
    fit_anchor_many(x, np.where(np.arange(30) == 4, np.inf, y)[None], np.ones((1, 30), bool), config=cfg)
  with pytest.raises(ValueError, match="sample_weights"):
    fit_anchor_many(x, y[None], np.ones((1, 30), bool), config=cfg, sample_weights=-np.ones((1, 30)))
  with pytest.raises(ValueError, match="huber_delta"):
    AnchorFitConfig(huber_delta=-1.0)


def test_residual_loss_huber():
  r = jnp.asarray([-3.0, -0.5, 0.0, 0.5, 3.0])
  np.testing.assert_allclose(residual_loss(r, 0.0), r ** 2)
  np.testing.assert_allclose(residual_loss(r, 1.0), [5.0, 0.25, 0.0, 0.25, 5.0])  # 2 * 1 * 3 - 1 beyond delta


def test_huber_is_pulled_less_by_an_outlier_label():
  x, y, _ = _data(p=40)
  y_bad = y.copy()
  y_bad[0] -= 40.0  # one label far too low, like a prompt whose N samples all missed the reward
  rest = np.arange(40) > 0
  err = {}
  for delta in (0.0, 0.5):
    cfg = AnchorFitConfig(hidden_sizes=(16,), batch_size=64, epochs=150, val_fraction=0.0, seed=0,
                          huber_delta=delta)
    pred = fit_anchor_many(x, y_bad[None], np.ones((1, 40), bool), config=cfg)[0]
    err[delta] = np.sqrt(np.mean((pred[rest] - y[rest]) ** 2))
    np.testing.assert_allclose(_single(x, y_bad, cfg), pred, atol=1e-4)  # fit_anchor uses the same loss
  assert err[0.5] < 0.7 * err[0.0], err


def test_best_epoch_selection_matches_fit_anchor_val_idx():
  x, y, _ = _data()
  y = y + np.random.default_rng(5).normal(scale=1.0, size=30)  # noisy labels: validation MSE turns up
  cfg = AnchorFitConfig(hidden_sizes=(64,), batch_size=64, epochs=120, learning_rate=1e-2, seed=1)
  val = np.arange(30) >= 24
  res = fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", config=cfg,
                   val_idx=np.flatnonzero(val))
  assert 0 < res.best_epoch < cfg.epochs - 1  # an interior epoch is selected
  pred = fit_anchor_many(x, y[None], (~val)[None], config=cfg, val_mask=val[None])
  np.testing.assert_allclose(pred[0], np.asarray(res.anchor(x)), atol=1e-4)
  last = fit_anchor_many(x, y[None], (~val)[None], config=cfg)
  assert np.mean((last[0, val] - y[val]) ** 2) > np.mean((pred[0, val] - y[val]) ** 2)
  with pytest.raises(ValueError, match="overlaps"):
    fit_anchor_many(x, y[None], np.ones((1, 30), bool), config=cfg, val_mask=val[None])


def test_fit_anchor_is_fit_anchor_many_with_one_fit():
  # One shared core: on fit_anchor's own split, minibatches (same shuffles) and weights included, both give
  # the same anchor, and fit_anchor's history belongs to the anchor it returns.
  x, y, w = _data(p=50)
  y = y + np.random.default_rng(5).normal(scale=0.7, size=50)  # noisy labels: validation MSE turns up
  cfg = AnchorFitConfig(hidden_sizes=(32,), batch_size=8, epochs=50, learning_rate=1e-2, val_fraction=0.2, seed=4)
  res = fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", config=cfg, sample_weights=w)
  train, val = res.train_idx, res.val_idx
  assert val.size == 10 and np.array_equal(np.union1d(train, val), np.arange(50))
  tm = np.isin(np.arange(50), train)[None]
  g = np.asarray(res.anchor(x), np.float64)
  pred = fit_anchor_many(x, y[None], tm, config=cfg, sample_weights=w[None], val_mask=~tm)
  np.testing.assert_allclose(g, pred[0], rtol=0, atol=1e-5)
  h, s = res.history, res.summary()
  assert len(h["train_mse"]) == len(h["val_mse"]) == len(h["val_r2"]) == cfg.epochs
  assert res.best_epoch == int(np.argmin(h["val_mse"])) and 0 < res.best_epoch < cfg.epochs - 1
  np.testing.assert_allclose(s["train_mse"], np.mean((g[train] - y[train]) ** 2), rtol=1e-4)
  np.testing.assert_allclose(s["val_mse"], np.mean((g[val] - y[val]) ** 2), rtol=1e-4)
  np.testing.assert_allclose(s["val_r2"], 1.0 - s["val_mse"] / np.var(y[val]), rtol=1e-9)
  assert res.anchor.meta.fit_summary == s and (s["n_train"], s["n_val"]) == (40, 10)
  # no validation split: the last epoch is kept and there is no validation history
  cfg0 = dataclasses.replace(cfg, val_fraction=0.0)
  res0 = fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", config=cfg0)
  assert res0.best_epoch == cfg.epochs - 1 and res0.history["val_mse"] == [] and res0.summary()["val_r2"] is None
  pred0 = fit_anchor_many(x, y[None], np.ones((1, 50), bool), config=cfg0)
  np.testing.assert_allclose(np.asarray(res0.anchor(x), np.float64), pred0[0], rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="all zero on the 40 training prompts"):
    fit_anchor(x, y, beta=1.0, reward_transform=RT, label_scale="sum", config=cfg, sample_weights=1.0 * ~tm[0])
