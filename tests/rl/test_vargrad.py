"""VarGrad (`objectives.VarGrad`, `losses.batch_log_z` / `vargrad_loss`): loss and gradient against a
direct NumPy implementation, its equality with the gradient of the group variance, and one trainer
step where the rollout-time estimate is the current policy's."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import config as config_lib
from disa_jax.rl import losses, objectives
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import read_jsonl
from disa_jax import testing
from disa_jax.rl.build import build_trainer
from disa_jax.rl.inputs import EngineLink, StepModels
from disa_jax.rl.replay import ReplayPool
from tests.rl.test_replay import _write_stage1
from tests.rl.test_trainer import TINY, RecordingEngine, _mesh1, _task

P, G, T, BETA = 3, 4, 5, 2.0


def _data(seed=0):
  rng = np.random.default_rng(seed)
  b = P * G
  lengths = rng.integers(1, T + 1, b)
  lengths[5] = 0  # an invalid (padding) row in group 1
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  logp = (-rng.uniform(0.1, 2.0, (b, T)) * mask).astype(np.float32)
  old = (logp + rng.normal(0, 0.3, (b, T)) * mask).astype(np.float32)
  ref = (logp + rng.normal(0, 0.5, (b, T)) * mask).astype(np.float32)
  reward = rng.integers(0, 2, b).astype(np.float32)
  return logp, old, ref, reward, mask


def _numpy_vargrad(logp, old, ref, reward, mask, *, scale, loo, omega):
  """The loss and d loss / d logp, written out row by row."""
  b = len(reward)
  lens = mask.sum(1)
  valid = lens > 0
  norm = np.where(lens > 0, lens, 1.0) if scale == "mean" else np.ones(b)
  seq = lambda x: (x * mask).sum(1) / norm
  t = BETA * reward - seq(old) + seq(ref)  # at pi_old, where the estimate is taken
  log_z = np.zeros(b)
  for i in range(b):
    g = i // G
    others = [j for j in range(g * G, (g + 1) * G) if valid[j] and (j != i or not loo)]
    log_z[i] = np.mean(t[others]) if valid[i] else 0.0
  if omega == "one":
    w = np.ones(b)
  else:  # clipped_ratio
    w = np.minimum(np.exp(((logp - old) * mask).sum(1)), 10.0)
  res = np.where(valid, log_z + seq(logp) - seq(ref) - BETA * reward, 0.0)
  nv = valid.sum()
  loss = (w * res**2)[valid].sum() / nv
  grad = (2.0 / nv) * (w * res / norm)[:, None] * mask * valid[:, None]
  return loss, grad, log_z


@pytest.mark.parametrize("scale,loo,omega", [("sum", False, "one"), ("mean", False, "one"),
                                             ("sum", True, "clipped_ratio"),
                                             ("mean", True, "clipped_ratio")])
def test_loss_and_gradient_match_numpy(scale, loo, omega):
  logp, old, ref, reward, mask = _data()
  obj = objectives.VarGrad(beta=BETA, scale=scale, leave_one_out=loo, omega=omega)
  log_z = losses.batch_log_z(old, ref, reward, mask, group_size=G, beta=BETA,
                             length_normalize=scale == "mean", leave_one_out=loo)
  batch = types.SimpleNamespace(log_z=log_z, ref_logp=ref, signal=reward, response_mask=mask,
                                old_logp=old)
  (loss, metrics), grad = jax.value_and_grad(lambda lp: obj.loss(lp, batch), has_aux=True)(
      jnp.asarray(logp))
  want_loss, want_grad, want_log_z = _numpy_vargrad(logp, old, ref, reward, mask, scale=scale,
                                                    loo=loo, omega=omega)
  np.testing.assert_allclose(log_z, want_log_z, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)
  assert np.isfinite(float(metrics["tb_residual_abs_mean"]))


def test_on_policy_gradient_is_the_gradient_of_the_group_variance():
  """At pi_old = pi_theta, the stop-gradient batch log Z gives the gradient of
  (1/B) sum_q sum_i (t_i - mean_q t)^2 differentiated through the mean (Richter et al. 2020)."""
  logp, _, ref, reward, mask = _data(1)
  valid = mask.sum(1) > 0

  def variance(lp):
    t = BETA * reward - (lp * mask).sum(1) + (ref * mask).sum(1)
    t_g, v_g = t.reshape(P, G), valid.reshape(P, G)
    mean = (t_g * v_g).sum(1, keepdims=True) / v_g.sum(1, keepdims=True)
    return (((t_g - mean) ** 2) * v_g).sum() / valid.sum()

  def vargrad(lp):
    log_z = losses.batch_log_z(lp, ref, reward, mask, group_size=G, beta=BETA,
                               length_normalize=False)
    return losses.vargrad_loss(log_z, lp, ref, reward, mask, beta=BETA,
                               length_normalize=False)[0]

  lp = jnp.asarray(logp)
  np.testing.assert_allclose(float(vargrad(lp)), float(variance(lp)), rtol=1e-5)
  np.testing.assert_allclose(jax.grad(vargrad)(lp), jax.grad(variance)(lp), rtol=1e-4, atol=1e-6)
  # Without the stop-gradient the two would differ: the gradient through log Z^ is not zero.
  no_sg = lambda lp: losses.tb_loss(  # pylint: disable=g-long-lambda
      (BETA * reward - (lp * mask).sum(1) + (ref * mask).sum(1)).reshape(P, G).mean(1), lp, ref,
      reward, mask, beta=BETA, length_normalize=False)[0]
  assert float(jnp.abs(jax.grad(no_sg)(lp) - jax.grad(vargrad)(lp)).max()) > 1e-3


def test_a_per_prompt_offset_cancels_exactly():
  """Any per-prompt shift of beta r~ (a log Z offset) leaves the loss and gradient unchanged."""
  logp, old, ref, reward, mask = _data(2)
  shift = np.repeat(np.array([3.0, -7.0, 0.5], np.float32), G) / BETA

  def run(r):
    log_z = losses.batch_log_z(old, ref, r, mask, group_size=G, beta=BETA, length_normalize=True)
    return jax.value_and_grad(lambda lp: losses.vargrad_loss(
        log_z, lp, ref, r, mask, beta=BETA, length_normalize=True)[0])(jnp.asarray(logp))

  (l0, g0), (l1, g1) = run(reward), run(reward + shift)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5)
  np.testing.assert_allclose(g1, g0, rtol=1e-4, atol=1e-5)


def test_config_registration_and_errors():
  cfg = config_lib.from_mapping(TrainConfig, {"objective": {
      "name": "vargrad", "scale": "mean", "leave_one_out": True}, "replay": {"fraction": 0.25}})
  obj = cfg.objective
  assert isinstance(obj, objectives.VarGrad) and obj.leave_one_out and obj.scale == "mean"
  assert obj.needs_batch_log_z and obj.needs_reference and obj.needs_old_logp
  assert not obj.needs_anchor and not obj.has_state and obj.allows_replay
  assert objectives.default_config("vargrad")["leave_one_out"] is False
  _, _, ref, reward, mask = _data()
  with pytest.raises(ValueError, match="group_size must divide"):
    losses.batch_log_z(ref, ref, reward, mask, group_size=5, beta=BETA, length_normalize=False)
  with pytest.raises(ValueError, match="omega must be one of"):
    config_lib.from_mapping(TrainConfig, {"objective": {"name": "vargrad", "omega": "x"}})


def _vargrad_trainer(workdir, *, reference_seed, replay=None):
  cfg = config_lib.from_mapping(TrainConfig, dict(
      objective=dict(name="vargrad", beta=2.0, scale="sum", reward_transform={"kind": "raw"}),
      optim=dict(lr=1e-3),
      rollout=dict(prompts_per_batch=2, group_size=4, max_prompt_len=8, max_response_len=6,
                   num_minibatches=1, micro_batch_rows=2),
      replay=dict(fraction=0.5, mode="add") if replay else {},
      checkpoint=dict(every=10, keep=1, async_save=False), total_steps=2, progress_bar=False),
      "train")
  return build_trainer(
      cfg, str(workdir),
      StepModels(testing.make_tiny_model(seed=0, **TINY),
                 testing.make_tiny_model(seed=reference_seed, **TINY), _mesh1(), pad_to=16),
      _task(replay_pool=ReplayPool.from_stage1(replay, max_response_len=6) if replay else None),
      EngineLink(RecordingEngine(testing.make_tiny_model(seed=0, **TINY))))


@pytest.mark.slow  # ~20 s: a tiny model's rollout, scoring and update compiled
def test_trainer_step_estimates_log_z_at_the_current_policy(tmp_path):
  """One update per rollout batch: the residuals of each group sum to 0 at the update (the logged
  mean residual is 0), with the pi_old pass on the host and the batch log Z in the residual."""
  trainer = _vargrad_trainer(tmp_path, reference_seed=1)  # pi_ref != pi_theta: log Z^ != 0
  # pi_old scored on the host for the estimate:
  assert trainer.parts.scorer.needs.old_logp == "recompute"
  trainer.run()
  trainer.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert len(rows) == 2
  for r in rows:
    assert abs(r["tb_residual_mean"]) < 1e-4 * max(1.0, r["tb_residual_abs_mean"]), r
    assert r["tb_residual_abs_mean"] > 1e-2 and abs(r["log_z_mean"]) > 1e-2


@pytest.mark.slow  # ~20 s, as above
def test_trainer_step_with_replayed_rows_in_the_groups(tmp_path):
  """Replay (mode 'add'): a group's replayed Stage 1 rows enter its estimate, so each enlarged
  group's residuals still sum to 0 at the update."""
  path = _write_stage1(tmp_path / "s1.jsonl")  # scored under the seed-0 reference
  trainer = _vargrad_trainer(tmp_path / "run", reference_seed=0, replay=path)
  trainer.run()
  trainer.close()
  for r in read_jsonl(str(tmp_path / "run" / "metrics.jsonl")):
    assert r["replay/fraction"] > 0 and r["num_sequences"] > 2 * 4
    assert abs(r["tb_residual_mean"]) < 1e-4 * max(1.0, r["tb_residual_abs_mean"]), r
    assert r["tb_residual_abs_mean"] > 1e-2
