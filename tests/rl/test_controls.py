"""The controls of the replay fix: KL-Cov as a GRPO option, supervised learning on the replayed
rows (`ReplaySft`), and a replay pool restricted to the first N Stage 1 samples."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import config as config_lib
from disa_jax.rl import config as rl_config
from disa_jax.rl import losses
from disa_jax.rl.objectives import Grpo, Objective, ReplaySft
from disa_jax.rl.replay import ReplayPool
from tests.rl import test_replay as TR
from tests.rl import test_trainer as T


def _inputs(seed=0, b=4, t=5):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-1.5, 0.7, (b, t)).astype(np.float32)
  old = (logp + rng.normal(0, 0.2, (b, t))).astype(np.float32)
  adv = rng.normal(0, 1, b).astype(np.float32)
  mask = np.ones((b, t), np.float32)
  mask[1, 3:] = 0
  mask[3, 1:] = 0
  return logp, old, adv, mask


def _kl_cov_numpy(logp, old, adv, mask, ratio, coef):
  tok = mask > 0
  a = np.broadcast_to(adv[:, None], logp.shape)
  cov = (a - a[tok].mean()) * (logp - logp[tok].mean())
  flat = np.where(tok, cov, -np.inf).ravel()
  k = max(int(np.floor(ratio * tok.sum())), 1)
  chosen = np.zeros(flat.size, bool)
  chosen[np.argsort(-flat, kind="stable")[:k]] = True
  chosen = chosen.reshape(logp.shape) & tok
  return np.where(chosen, coef * np.abs(logp - old), 0.0), chosen


@pytest.mark.parametrize("ratio", [0.01, 0.2, 0.5])
def test_kl_cov_penalises_the_top_covariance_tokens_like_a_direct_implementation(ratio):
  logp, old, adv, mask = _inputs()
  pen, chosen = losses.kl_cov_penalty(logp, old, adv, mask, ratio=ratio, coef=0.7)
  want_pen, want_chosen = _kl_cov_numpy(logp, old, adv, mask, ratio, 0.7)
  np.testing.assert_array_equal(np.asarray(chosen), want_chosen)
  np.testing.assert_allclose(np.asarray(pen), want_pen, rtol=1e-6)
  assert want_chosen.sum() == max(int(ratio * mask.sum()), 1)
  # the gradient reaches the chosen tokens only: d/dlogp coef |logp - old| = coef sign(logp - old)
  g = jax.grad(lambda lp: losses.kl_cov_penalty(lp, old, adv, mask, ratio=ratio, coef=0.7)[0].sum())(
      jnp.asarray(logp))
  np.testing.assert_allclose(np.asarray(g), np.where(want_chosen, 0.7 * np.sign(logp - old), 0.0),
                             rtol=1e-6)


def test_grpo_with_kl_cov_adds_the_penalty_to_the_clipped_surrogate():
  logp, old, adv, mask = _inputs(seed=1)
  kw = dict(eps_low=0.2, eps_high=0.28, loss_agg="token-mean")
  base, _ = losses.grpo_loss(logp, old, adv, mask, **kw)
  with_cov, m = losses.grpo_loss(logp, old, adv, mask, kl_cov_ratio=0.2, kl_cov_coef=1.0, **kw)
  pen, chosen = _kl_cov_numpy(logp, old, adv, mask, 0.2, 1.0)
  assert float(with_cov) == pytest.approx(float(base) + pen.sum() / mask.sum(), rel=1e-5)
  assert float(m["kl_cov_frac"]) == pytest.approx(chosen.sum() / mask.sum())


def test_the_grpo_option_reaches_the_loss_and_bad_values_are_refused():
  g = config_lib.from_mapping(Objective, {"name": "grpo", "eps_high": 0.28, "kl_cov_ratio": 0.2})
  assert isinstance(g, Grpo) and g.kl_cov_ratio == 0.2 and g.kl_cov_coef == 1.0
  logp, old, adv, mask = _inputs(seed=2)
  batch = type("B", (), dict(old_logp=old, signal=adv, response_mask=mask, ref_logp=None))
  loss, m = g.loss(logp, batch)
  assert "kl_cov_frac" in m and float(loss) != float(Grpo(eps_high=0.28).loss(logp, batch)[0])
  with pytest.raises(ValueError, match="kl_cov_ratio must be in \\[0, 1\\) \\(0 = off\\), got 1.5"):
    Grpo(kl_cov_ratio=1.5)
  with pytest.raises(ValueError, match="kl_cov_coef must be >= 0, got -1"):
    Grpo(kl_cov_coef=-1)
  with pytest.raises(ValueError, match="kl_cov ratio must be in \\(0, 1\\), got 0.0"):
    losses.kl_cov_penalty(logp, old, adv, mask, ratio=0.0, coef=1.0)


def test_sft_loss_is_the_weighted_nll_of_whole_responses():
  logp, _, _, mask = _inputs(seed=3)
  w = np.asarray([1.0, 0.0, 1.0, 1.0], np.float32)
  loss, m = losses.sft_loss(logp, w, mask)
  nll = -(logp * mask).sum(1)
  assert float(loss) == pytest.approx((w * nll).sum() / 4, rel=1e-6)
  assert float(m["nll"]) == pytest.approx((w * nll).sum() / 3, rel=1e-6) and m["weighted_rows"] == 3
  g = jax.grad(lambda lp: losses.sft_loss(lp, w, mask)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(np.asarray(g), -w[:, None] * mask / 4, rtol=1e-6)


def test_replay_sft_learns_from_replayed_correct_rows_only_and_needs_replay():
  o = ReplaySft()
  reward = np.asarray([[1.0, 0.0, 1.0, 1.0, 0.0, 1.0]])
  is_replay = np.asarray([[False, False, False, False, True, True]])
  np.testing.assert_array_equal(o.batch_signal(reward, is_replay), [[0, 0, 0, 0, 0, 1]])
  assert Grpo().batch_signal(reward, is_replay).shape == (1, 6)  # others: row_signal
  with pytest.raises(ValueError, match="'replay_sft' learns from replayed rows only.*got 0.0"):
    dataclasses.replace(T._cfg(), objective=o)


@pytest.mark.slow
def test_replay_sft_trains_in_the_trainer_on_the_replayed_rows(tmp_path):
  path = TR._write_stage1(tmp_path / "s1.jsonl")
  cfg = dataclasses.replace(TR._replay_cfg("disa", mode="add"), objective=ReplaySft(),
                            rollout=dataclasses.replace(T._cfg().rollout, micro_batch_rows=3))
  trainer, _ = TR._trainer(cfg, tmp_path / "run", path)
  batch = trainer.parts.collector.collect(0)
  # The replayed rows are scored without error.
  trainer.parts.scorer.score(trainer.parts.updater.pack(0, batch),
                             trainer.parts.updater.state.params)
  signal = cfg.objective.batch_signal(batch.grouped_reward,
                                      batch.is_replay.reshape(batch.grouped_reward.shape))
  np.testing.assert_array_equal(signal.reshape(-1), (batch.reward > 0.5) & batch.is_replay)
  metrics = trainer.step(1)
  assert np.isfinite(metrics["loss"]) and "nll" in metrics
  trainer.close()


@pytest.mark.slow
def test_the_pool_can_keep_only_the_first_n_samples(tmp_path):
  path = TR._write_stage1(tmp_path / "s1.jsonl", n=5)
  pool = ReplayPool.from_stage1(path, max_response_len=6, first_samples=2)
  assert all(len(ss) <= 2 for ss in pool.samples.values())
  assert pool.skipped["beyond_first_samples"] == 4 * 3
  full = ReplayPool.from_stage1(path, max_response_len=6)
  for pid, ss in pool.samples.items():
    assert [s.token_ids.tolist() for s in ss] == [s.token_ids.tolist() for s in full.samples[pid][:2]]
  with pytest.raises(ValueError, match="replay.first_samples must be >= 0 \\(0 = every sample\\), got -1"):
    rl_config.ReplayConfig(fraction=0.5, first_samples=-1)
