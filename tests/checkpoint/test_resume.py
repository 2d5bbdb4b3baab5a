"""kill -9 resume: the resumed run's per-step metrics equal an uninterrupted run's (CPU)."""
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from disa_jax.checkpoint import CheckpointManager, array_to_rng, rng_to_array
from disa_jax.rl.metrics import MetricsLogger, read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "checkpoint", "resume_worker.py")
STEPS = 30


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = ""  # one CPU device, like the reference run
  return env


def _run(workdir, *extra):
  return subprocess.Popen([sys.executable, WORKER, "--workdir", str(workdir), "--steps", str(STEPS),
                           *extra], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _lines(path):
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum(1 for line in f if line.endswith("\n"))


# The kill points are drawn from these listed seeds (never from the clock), so a failure names a
# seed that reproduces it: the steps after which each kill lands and the offset inside the step.
# Seed 2 kills early, after steps 4 and 5; seed 3 mid-run and late, after steps 10 and 21.
KILL_SEEDS = (2, 3)


def _kill_plan(seed, rounds, first, last, max_offset_s):
  """[(kill after >= this many metric lines, extra sleep in s)] for `rounds` kills at distinct,
  increasing steps in [first, last]."""
  rnd = random.Random(seed)
  targets = sorted(rnd.sample(range(first, last + 1), rounds))
  return [(t, rnd.uniform(0.0, max_offset_s)) for t in targets]


@pytest.fixture(scope="module")
def uninterrupted_metrics(tmp_path_factory):
  """The reference run's per-step metrics (computed once for every kill seed)."""
  ref_dir = tmp_path_factory.mktemp("resume_ref")
  ref = _run(ref_dir)
  out, _ = ref.communicate(timeout=300)
  assert ref.returncode == 0, out.decode()
  expected = read_jsonl(str(ref_dir / "metrics.jsonl"))
  assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
  return expected


@pytest.mark.slow
@pytest.mark.parametrize("seed", KILL_SEEDS)
def test_kill9_resume_matches_uninterrupted(tmp_path, uninterrupted_metrics, seed):
  plan = _kill_plan(seed, 2, 3, STEPS - 5, 0.05)
  work = tmp_path / "killed"
  metrics_path = str(work / "metrics.jsonl")
  for kill_round, (target, offset_s) in enumerate(plan):
    proc = _run(work, "--sleep", "0.05")
    deadline = time.time() + 300
    while _lines(metrics_path) < target and proc.poll() is None and time.time() < deadline:
      time.sleep(0.005)
    time.sleep(offset_s)  # land anywhere inside a step, including mid-save
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"round {kill_round} (seed {seed}, plan {plan}) " \
                                               "exited before the kill"
  latest = CheckpointManager(work / "ckpt").latest_step()
  assert latest is not None and latest < STEPS, latest
  resumed = _run(work)
  out, _ = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, out.decode()
  got = read_jsonl(metrics_path)
  assert got == uninterrupted_metrics, f"kill seed {seed}, plan {plan}"


def test_kill_plans_are_fixed_by_their_seed():
  plans = [_kill_plan(seed, 2, 3, STEPS - 5, 0.05) for seed in KILL_SEEDS]
  assert plans == [_kill_plan(seed, 2, 3, STEPS - 5, 0.05) for seed in KILL_SEEDS]
  assert [[t for t, _ in plan] for plan in plans] == [[4, 5], [10, 21]]  # as documented above
  assert all(3 <= t <= STEPS - 5 and 0 <= o <= 0.05 for plan in plans for t, o in plan)


def test_restore_roundtrip_and_keep_last_k(tmp_path):
  params = {"w": jax.numpy.arange(6.0).reshape(2, 3), "b": jax.numpy.ones(3)}
  opt = optax.adamw(1e-3)
  state = {"params": params, "opt": opt.init(params), "rng": rng_to_array(jax.random.key(7))}
  with CheckpointManager(tmp_path / "c", max_to_keep=2) as mngr:
    assert mngr.latest_step() is None
    with pytest.raises(FileNotFoundError):
      mngr.restore(state)
    for s in range(1, 5):
      state = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, state)
      mngr.save(s, state, {"data_position": 10 * s})
  mngr = CheckpointManager(tmp_path / "c")
  assert mngr.all_steps() == [3, 4]
  step, restored, meta = mngr.restore(jax.tree.map(np.zeros_like, state))
  assert step == 4 and meta == {"data_position": 40}
  jax.tree.map(np.testing.assert_array_equal, restored, state)
  np.testing.assert_array_equal(jax.random.key_data(array_to_rng(restored["rng"])),
                                jax.random.key_data(jax.random.key(7)))
  with pytest.raises(ValueError, match="max_to_keep must be >= 1, got 0"):
    CheckpointManager(tmp_path / "d", max_to_keep=0)


def test_metrics_logger_truncates_on_resume(tmp_path):
  with MetricsLogger(str(tmp_path), tensorboard=True) as log:
    for s in range(1, 6):
      log.write(s, {"a": s * 1.5})
  with MetricsLogger(str(tmp_path), resume_step=3, tensorboard=False) as log:
    log.write(4, {"a": -1.0})
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["a"]) for r in rows] == [(1, 1.5), (2, 3.0), (3, 4.5), (4, -1.0)]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))
  with pytest.raises(ValueError, match="metric 'v' is not a scalar"):
    with MetricsLogger(str(tmp_path / "x"), tensorboard=False) as log:
      log.write(1, {"v": [1.0, 2.0]})


@pytest.mark.slow
@pytest.mark.parametrize("seed", [5])
def test_kill9_resume_of_the_stage3_trainer(tmp_path, seed):
  """The real DISA trainer (tiny model, JAX sampler): kill -9 mid-run, resume, compare metrics."""
  steps = 8
  env = _env()  # later processes reuse compiles (the session's cache, tests/conftest.py)
  worker = os.path.join(ROOT, "tests", "checkpoint", "trainer_worker.py")

  def start(workdir):
    return subprocess.Popen([sys.executable, worker, str(workdir), str(steps)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

  ref = start(tmp_path / "ref")
  out, _ = ref.communicate(timeout=600)
  assert ref.returncode == 0, out.decode()[-3000:]
  expected = read_jsonl(str(tmp_path / "ref" / "metrics.jsonl"))
  assert [r["step"] for r in expected] == list(range(1, steps + 1))

  ((target, offset_s),) = _kill_plan(seed, 1, 2, steps - 2, 0.2)
  work = tmp_path / "killed"
  proc = start(work)
  deadline = time.time() + 600
  while _lines(str(work / "metrics.jsonl")) < target and proc.poll() is None:
    assert time.time() < deadline
    time.sleep(0.005)
  time.sleep(offset_s)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL, f"worker finished before the kill (seed {seed})"
  resumed = start(work)
  out, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, out.decode()[-3000:]
  strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time/")
                         and k != "tokens_per_s"} for r in rows]
  got = read_jsonl(str(work / "metrics.jsonl"))
  assert strip(got) == strip(expected), f"kill seed {seed}, killed after >= {target} steps"
