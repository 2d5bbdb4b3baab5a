"""Asynchronous rollouts (`disa_jax.rl.async_rollout`), the behaviour corrections and the mismatch
metric: analytic values, a stale run's versions and losses, and in-flight batches across resume."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import models
from disa_jax.config import from_mapping
from disa_jax.rl import async_rollout, losses
from disa_jax.rl.batch import RolloutBatch
from disa_jax.rl import seeds
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.metrics import read_jsonl
from tests.rl import test_trainer as tt
from tests.rl.helpers import assert_golden_rows

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "rl"
WORKER = ROOT / "tests" / "rl" / "stage3_worker.py"

# -- analytic: TIS / MIS and the mismatch metric ------------------------------------------------

OLD = np.array([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]], np.float32)
MU = np.array([[-1.5, -1.0, -0.5], [-0.3, -2.5, 0.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)


@pytest.mark.parametrize("mode", ["tis", "mis", "none"])
def test_token_is_weights_match_the_direct_formula(mode):
  on = np.array([1.0, 1.0], np.float32)
  w, m = losses.behaviour_is_weights(OLD, MU, MASK, on, mode=mode, cap=2.0, level="token")
  rho = np.exp(OLD - MU)  # pi_old / mu per token: e^.5, e^-1, 1 | 1, e^1.3, (pad)
  want = {"tis": np.minimum(rho, 2.0), "mis": np.where(rho <= 2.0, rho, 0.0),
          "none": np.ones_like(rho)}[mode]
  want = np.where(MASK > 0, want, 1.0)
  np.testing.assert_allclose(np.asarray(w), want, rtol=1e-6)
  assert float(m["is_capped_frac"]) == pytest.approx(1 / 5)  # e^1.3 = 3.67 > 2 only


def test_sequence_is_weights_use_the_geometric_mean_and_skip_replayed_rows():
  on = np.array([1.0, 0.0], np.float32)  # row 1 replayed: weight 1 whatever its ratio
  w, _ = losses.behaviour_is_weights(OLD, MU, MASK, on, mode="tis", cap=1.1, level="sequence")
  geo = np.exp(np.mean([0.5, -1.0, 0.0]))  # row 0: 0.61
  np.testing.assert_allclose(np.asarray(w), [min(geo, 1.1), 1.0], rtol=1e-6)


def test_grpo_and_gspo_scale_each_term_by_its_weight():
  logp = jnp.asarray(OLD + 0.05)
  adv = jnp.asarray([1.0, -0.5])
  w_tok = np.array([[0.5, 2.0, 1.0], [1.0, 0.0, 1.0]], np.float32)
  loss, _ = losses.grpo_loss(logp, OLD, adv, MASK, is_weights=w_tok)
  ratio = np.exp(0.05)
  per_tok = -np.minimum(ratio * np.array([[1.0], [-0.5]]),
                        np.clip(ratio, 0.8, 1.2) * np.array([[1.0], [-0.5]])) * w_tok
  want = np.mean([(per_tok[0] * MASK[0]).sum() / 3, (per_tok[1] * MASK[1]).sum() / 2])
  assert float(loss) == pytest.approx(want, rel=1e-5)
  w_seq = np.array([0.25, 3.0], np.float32)
  loss, _ = losses.gspo_loss(logp, OLD, adv, MASK, eps_low=0.2, eps_high=0.2, is_weights=w_seq)
  per_seq = -np.minimum(ratio * np.array([1.0, -0.5]),
                        np.clip(ratio, 0.8, 1.2) * np.array([1.0, -0.5])) * w_seq
  assert float(loss) == pytest.approx(per_seq.mean(), rel=1e-5)


def test_mismatch_metric_reads_a_known_perturbation():
  delta = np.array([[0.3, -0.05, 0.0], [0.2, 0.0, 9.0]], np.float32)  # 9.0 sits on padding
  on = np.array([1.0, 1.0], np.float32)
  m = losses.mismatch_metrics(OLD, OLD - delta, MASK, on, threshold=0.1)
  assert float(m["mismatch/logp_diff_mean"]) == pytest.approx((0.3 - 0.05 + 0.2) / 5)
  assert float(m["mismatch/logp_abs_mean"]) == pytest.approx((0.3 + 0.05 + 0.2) / 5)
  assert float(m["mismatch/logp_abs_max"]) == pytest.approx(0.3)
  assert float(m["mismatch/frac_over"]) == pytest.approx(2 / 5)


def test_staleness_config_is_validated():
  with pytest.raises(ValueError, match=r"rollout.max_staleness must be an int >= 0.*-1"):
    from_mapping(TrainConfig, {"rollout": {"max_staleness": -1}}, "train")
  with pytest.raises(ValueError, match=r"rollout.old_logp_source must be 'recompute' with "
                                       r"rollout.max_staleness=2"):
    from_mapping(TrainConfig, {"rollout": {"max_staleness": 2, "old_logp_source": "engine"}},
                 "train")
  with pytest.raises(ValueError, match=r"is_correction must be one of .*'clip'"):
    from_mapping(TrainConfig, {"objective": {"name": "grpo", "is_correction": "clip"}}, "train")


# -- a stale run end to end (in-process JAX sampler) ---------------------------------------------


class VersionedEngine(tt.RecordingEngine):
  """Records, for every generate call, its seed and how many weight pushes preceded it; can add a
  known offset to the log-probs it reports."""

  def __init__(self, model, offset=0.0):
    super().__init__(model)
    self.pushes, self.calls, self.offset = 0, [], offset

  def update_weights(self, state_dict):
    super().update_weights(state_dict)
    self.pushes += 1

  def load_params(self, source, dtype=None):
    super().load_params(source, dtype)
    self.pushes += 1

  def generate(self, prompts, params):
    self.calls.append((params.seed, self.pushes))
    out = super().generate(prompts, params)
    for group in out:
      for c in group:
        c.logprobs = c.logprobs + np.float32(self.offset)
    return out


def _stale_trainer(method, k, workdir, steps=4, offset=0.0, **objective):
  """`tests/rl/test_trainer.py`'s tiny trainer at staleness k, with a `VersionedEngine`."""
  cfg = tt._cfg(method, steps=steps, **objective)  # pylint: disable=protected-access
  cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_staleness=k))
  engine = VersionedEngine(tt.testing.make_tiny_model(seed=0, **tt.TINY), offset)
  trainer, _ = tt._trainer(cfg, workdir, engine=engine)  # pylint: disable=protected-access
  scored = []
  score = trainer.parts.scorer.score

  def recording_score(batch, params):
    out = score(batch, params)
    scored.append(out)
    return out

  trainer.parts.scorer.score = recording_score
  return trainer, engine, scored


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
def test_each_batch_is_sampled_by_the_weights_k_updates_old_and_tb_reads_its_log_probs(
    tmp_path, k):
  trainer, engine, scored = _stale_trainer("disa", k, tmp_path, steps=5)
  history = trainer.run()
  trainer.close()
  versions = {seed: pushes for seed, pushes in engine.calls}
  for step in range(5 + k):  # the last k batches were sampled ahead for a longer run
    assert versions[seeds.rollout_seed(0, step)] == max(step - k, 0), step
  assert [b.rollout.policy_version for b in scored] == [max(s - k, 0) for s in range(5)]
  assert [r["rollout/staleness"] for r in history] == [min(s, k) for s in range(5)]
  # TB (omega = clipped_ratio) weighs stale rows by pi_theta / mu: old_logp is the engine's.
  for b in scored:
    np.testing.assert_array_equal(b.old_logp, b.packed.sequence_values(
        b.packed.slot_tokens(b.rollout.behaviour_logp())))


def test_grpo_with_tis_recomputes_pi_old_and_corrects_the_stale_rows(tmp_path):
  trainer, _, scored = _stale_trainer("grpo", 1, tmp_path, steps=3, is_correction="tis",
                                      is_cap=2.0)
  history = trainer.run()
  trainer.close()
  stale = scored[1]
  assert stale.rollout.policy_version == 0
  behaviour = stale.packed.sequence_values(stale.packed.slot_tokens(stale.rollout.behaviour_logp()))
  gap = np.abs(stale.old_logp - behaviour).max()
  assert gap > 1e-3  # pi_old (weights 1) is not the behaviour (weights 0)
  assert all(0 < r["is_weight_mean"] <= 2.0 for r in history)


def test_mismatch_is_logged_every_step_and_reads_the_engines_offset(tmp_path):
  trainer, _, _ = _stale_trainer("disa", 0, tmp_path / "exact", steps=2)
  same = trainer.run()
  trainer.close()
  assert all(r["mismatch/logp_abs_mean"] < 1e-4 for r in same)  # the same fp32 weights
  trainer, _, _ = _stale_trainer("disa", 0, tmp_path / "off", steps=2, offset=-0.3)
  off = trainer.run()
  trainer.close()
  for r in off:  # the engine reports log mu 0.3 nats low: log pi_trainer - log mu = +0.3
    assert r["mismatch/logp_diff_mean"] == pytest.approx(0.3, abs=1e-3)
    assert r["mismatch/frac_over"] == 1.0


def test_in_flight_batches_round_trip(tmp_path):
  b = RolloutBatch(
      prompt_ids=["a", "b"], prompt_tokens=[(3, 4), (5,)], group_size=2, response_width=3,
      response_ids=[np.array(x, np.int32) for x in ([7, 2], [8], [9, 9, 2], [6])],
      reward=np.array([1, 0, 1, 1], np.float32), grade_error=np.array([0, 0, 1, 0], bool),
      is_replay=np.array([0, 0, 0, 1], bool),
      sampled_logp=[np.array(x, np.float32) for x in ([-.5, -.1], [-2.], [-.3, -.2, -.1])] + [None],
      engine_logp=[None, None, None, None], finish_reason=["stop", "length", "stop", "replay"],
      stored_ref_logp=np.array([np.nan, np.nan, np.nan, -3.25]), generate_s=0.5,
      policy_version=3)
  async_rollout.save_batches(tmp_path / "f.npz", {4: b})
  back = async_rollout.load_batches(tmp_path / "f.npz")[4]
  for f in dataclasses.fields(RolloutBatch):
    x, y = getattr(b, f.name), getattr(back, f.name)
    if isinstance(x, np.ndarray):
      np.testing.assert_array_equal(x, y)
    elif isinstance(x, list) and x and isinstance(x[0], np.ndarray):
      assert all((p is None and q is None) or np.array_equal(p, q) for p, q in zip(x, y))
    else:
      assert x == y, f.name


@pytest.mark.slow
def test_resume_mid_async_run_continues_exactly(tmp_path):
  full, _, _ = _stale_trainer("disa", 1, tmp_path / "full", steps=4)
  full.run()
  full.close()
  part, _, _ = _stale_trainer("disa", 1, tmp_path / "part", steps=2)
  part.run()
  part.close()
  assert sorted(p.name for p in (tmp_path / "part" / "in_flight").iterdir()) == ["1.npz", "2.npz"]
  rest, _, _ = _stale_trainer("disa", 1, tmp_path / "part", steps=4)
  assert rest.start_step == 2
  rest.run()
  rest.close()
  assert tt._strip_time(read_jsonl(str(tmp_path / "part" / "metrics.jsonl"))) == tt._strip_time(  # pylint: disable=protected-access
      read_jsonl(str(tmp_path / "full" / "metrics.jsonl")))
  (tmp_path / "part" / "in_flight" / "4.npz").unlink()
  with pytest.raises(ValueError, match=r"checkpoint 4 was written with rollout.max_staleness=1 "
                                       r"but its in-flight rollouts .*4.npz are missing"):
    _stale_trainer("disa", 1, tmp_path / "part", steps=5)


@pytest.mark.slow
def test_k0_reproduces_the_synchronous_loop(tmp_path, default_xla_optimizations):
  """k = 0 runs the loop of commit ae9f951, before asynchronous rollouts: the same metrics.

  The fixture was written there with, per method, ``t, _ = tt._trainer(tt._cfg(method, steps=3),
  d); tt._strip_time(t.run())``, with XLA's default optimizations. Equal on the machine that wrote
  it; compared to float32 rounding here (`helpers.assert_golden_rows`).
  """
  golden = json.loads((FIXTURES / "sync_loop_ae9f951.json").read_text())
  for method, rows in golden.items():
    trainer, _ = tt._trainer(tt._cfg(method, steps=3), tmp_path / method)  # pylint: disable=protected-access
    assert trainer.parts.pipeline is None
    now = tt._strip_time(trainer.run())  # pylint: disable=protected-access
    trainer.close()
    # Keys added since ae9f951: staleness, the mismatch metrics, the clipped share and the
    # measurement window's means of the step logs (issue 62).
    new = {"rollout/staleness", "grad_clipped_share"} | {
        k for r in now for k in r if k.startswith(("mismatch/", "window/"))}
    assert [sorted(set(r) - new) for r in now] == [sorted(r) for r in rows]
    assert_golden_rows(now, rows, exact=False, what=method)
    assert all(r["rollout/staleness"] == 0 for r in now)


class _DeadEngine:
  """An engine whose process died during a push: the push fails naming the death, every call
  after it only finds the engine closed."""

  def update_weights(self, weights):
    raise async_rollout.concurrent.futures.BrokenExecutor("generation process (pid 7) died with "
                                                          "exit code -9 (SIGKILL)")

  def generate(self, *args):
    raise RuntimeError("generation process is closed")


class _Collector:

  def __init__(self, engine):
    self.engine = engine

  def sample(self, step, version):
    return self.engine.generate(step, version)

  def finish(self, local):
    return local


def test_a_failed_push_is_the_error_of_the_sampling_after_it():
  engine = _DeadEngine()
  pipe = async_rollout.RolloutPipeline(_Collector(engine), engine, max_staleness=1)
  pipe.start(0, {})  # steps 0 and 1, sampled before any push, fail as they are
  try:
    for step in (0, 1):
      with pytest.raises(RuntimeError, match="closed"):
        pipe.take(step)
    pipe.advance(1, {"w": np.zeros(1)})  # the push fails (the process died), then sampling step 2
    with pytest.raises(async_rollout.concurrent.futures.BrokenExecutor,
                       match=r"died with exit code -9 \(SIGKILL\)"):
      pipe.take(2)
    with pytest.raises(async_rollout.concurrent.futures.BrokenExecutor, match="exit code -9"):
      pipe.wait_idle()
  finally:
    pipe.close()


@pytest.mark.slow
def test_kill_9_mid_async_run_then_rerun_continues_exactly(tmp_path):
  """The trainer (engine in its own process, k = 1) killed with SIGKILL mid-run; the rerun's
  metrics equal an uninterrupted run's."""
  model_dir = str(tmp_path / "model")
  models.save_pretrained(tt.testing.make_tiny_model(seed=0, **tt.TINY), model_dir)
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")
  start = lambda work: subprocess.Popen(
      [sys.executable, str(WORKER), str(work), "6", model_dir, "--staleness", "1"], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  ref = start(tmp_path / "ref")
  out, _ = ref.communicate(timeout=600)
  assert ref.returncode == 0, out[-3000:]
  expected = read_jsonl(str(tmp_path / "ref" / "metrics.jsonl"))
  assert [r["rollout/staleness"] for r in expected] == [0, 1, 1, 1, 1, 1]

  work = tmp_path / "killed"
  proc = start(work)
  deadline = time.time() + 600
  while not (work / "metrics.jsonl").exists() or len(read_jsonl(str(work / "metrics.jsonl"))) < 3:
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGKILL)  # mid-run: the rollout thread has step 4 or 5 in flight
  proc.communicate(timeout=120)
  assert 3 <= len(read_jsonl(str(work / "metrics.jsonl"))) < 6
  rerun = start(work)
  out, _ = rerun.communicate(timeout=600)
  assert rerun.returncode == 0, out[-3000:]
  assert tt._strip_time(read_jsonl(str(work / "metrics.jsonl"))) == tt._strip_time(expected)  # pylint: disable=protected-access
