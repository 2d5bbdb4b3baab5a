"""DISA with its batch-centred frozen log Z (`objectives.DisaCentred`, `losses.batch_centred_log_z`;
issue 63's control): the centring against a direct NumPy implementation, the gradient as DISA's
minus a constant baseline, why the cell centres over the batch and not per prompt (that is VarGrad),
and one trainer step."""
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import config as config_lib
from disa_jax.rl import losses, objectives
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import read_jsonl
from tests.rl.test_trainer import _cfg, _trainer
from tests.rl.test_vargrad import BETA, G, _data

LOG_Z = np.array([4.0, -1.5, 9.0], np.float32)  # [P] a frozen log Z that differs across prompts


def _numpy_centred(log_z, old, ref, reward, mask, *, scale):
  lens = mask.sum(1)
  valid = lens > 0
  norm = np.where(valid, lens, 1.0) if scale == "mean" else np.ones(len(reward))
  seq = lambda x: (x * mask).sum(1) / norm
  lz = np.repeat(log_z, G)
  res = lz + seq(old) - seq(ref) - BETA * reward
  return np.where(valid, lz - res[valid].mean(), 0.0)


@pytest.mark.parametrize("scale", ["sum", "mean"])
def test_centred_log_z_matches_numpy_and_zeroes_the_batch_mean_residual(scale):
  logp, old, ref, reward, mask = _data()
  got = losses.batch_centred_log_z(LOG_Z, old, ref, reward, mask, beta=BETA,
                                   length_normalize=scale == "mean")
  np.testing.assert_allclose(got, _numpy_centred(LOG_Z, old, ref, reward, mask, scale=scale),
                             rtol=1e-5, atol=1e-5)
  valid = mask.sum(1) > 0
  res = losses.tb_residual(got, old, ref, reward, mask, beta=BETA,
                           length_normalize=scale == "mean")
  assert abs(float(np.asarray(res)[valid].mean())) < 1e-4  # centred over the whole batch
  assert float(np.abs(np.asarray(res)).max()) > 1e-1  # ... but not per row
  # log Z's differences across prompts are kept: one constant was removed from every valid row
  shift = np.repeat(LOG_Z, G)[valid] - np.asarray(got)[valid]
  np.testing.assert_allclose(shift, shift[0], rtol=1e-5, atol=1e-5)
  assert got[5] == 0.0  # the invalid row


def test_gradient_is_disas_with_a_constant_baseline_and_not_vargrads():
  """On-policy (pi_old = pi_theta) the centred loss's gradient is DISA's at log Z - c, c the batch
  mean residual, and it differs from VarGrad's (per-prompt centring) when the prompts' mean
  residuals differ; centring each prompt's group of the same frozen log Z IS VarGrad."""
  logp, _, ref, reward, mask = _data(1)
  kw = dict(beta=BETA, length_normalize=False)
  centred = losses.batch_centred_log_z(LOG_Z, logp, ref, reward, mask, **kw)
  valid = mask.sum(1) > 0
  c = float(np.asarray(losses.tb_residual(LOG_Z, logp, ref, reward, mask, **kw))[valid].mean())
  grad = lambda lz, fn=losses.disa_loss: jax.grad(lambda lp: fn(lz, lp, ref, reward, mask,
                                                               **kw)[0])(jnp.asarray(logp))
  np.testing.assert_allclose(grad(centred), grad(LOG_Z - c), rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(grad(centred) - grad(LOG_Z)).max()) > 1e-3  # the baseline moved
  vg = losses.batch_log_z(logp, ref, reward, mask, group_size=G, **kw)
  g_vg = grad(vg, losses.vargrad_loss)
  assert float(jnp.abs(grad(centred) - g_vg).max()) > 1e-3
  per_prompt = np.concatenate([
      LOG_Z[p] - np.asarray(losses.tb_residual(LOG_Z, logp, ref, reward, mask, **kw))[
          p * G:(p + 1) * G][valid[p * G:(p + 1) * G]].mean() * np.ones(G, np.float32)
      for p in range(len(LOG_Z))])
  np.testing.assert_allclose(grad(per_prompt), g_vg, rtol=1e-4, atol=1e-5)


def test_objective_declares_its_needs_and_reads_the_anchor_at_pi_old():
  cfg = config_lib.from_mapping(TrainConfig, {"objective": {"name": "disa_centred", "beta": BETA}})
  obj = cfg.objective
  assert isinstance(obj, objectives.DisaCentred) and isinstance(obj, objectives.Disa)
  assert obj.needs_anchor and obj.needs_batch_log_z and obj.needs_old_logp
  needs = obj.needs(cfg.rollout)
  assert needs.anchor and needs.batch_log_z and needs.old_logp == "recompute"
  logp, old, ref, reward, mask = _data(3)
  rollout = types.SimpleNamespace(
      response_ids=[tuple(range(int(n))) for n in mask.sum(1)], response_width=mask.shape[1])
  batch = types.SimpleNamespace(log_z=np.repeat(LOG_Z, G), old_logp=old, ref_logp=ref,
                                signal=reward, rollout=rollout)
  np.testing.assert_allclose(
      obj.batch_log_z(batch), _numpy_centred(LOG_Z, old, ref, reward, mask, scale="sum"),
      rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"DisaCentred.batch_log_z needs batch.log_z"):
    obj.batch_log_z(types.SimpleNamespace(log_z=None, old_logp=old, ref_logp=ref, signal=reward,
                                          rollout=rollout))


@pytest.mark.slow  # ~20 s: a tiny model's rollout, scoring and update compiled
def test_trainer_step_centres_the_anchor_over_the_batch(tmp_path):
  """One update per rollout batch: the logged mean residual is 0 at the update while the rows'
  log Z keep the anchor's spread; DISA's own run logs a mean residual far from 0."""
  cfg = _cfg("disa", steps=2)  # the tiny trainer's DISA settings (beta 2, mean scale)
  cfg = dataclasses.replace(cfg, objective=objectives.DisaCentred(beta=2.0, scale="mean"),
                            rollout=dataclasses.replace(cfg.rollout, num_minibatches=1))
  trainer, _ = _trainer(cfg, tmp_path / "c")
  assert trainer.parts.scorer.needs.old_logp == "recompute"
  trainer.run()
  trainer.close()
  rows = read_jsonl(str(tmp_path / "c" / "metrics.jsonl"))
  assert len(rows) == 2
  for r in rows:
    assert abs(r["tb_residual_mean"]) < 1e-4 * max(1.0, r["tb_residual_abs_mean"]), r
    assert r["tb_residual_abs_mean"] > 1e-2
