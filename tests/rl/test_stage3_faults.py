"""Stage 3 under bad inputs and faults: NaN rewards, no prompts, a checkpoint of another model, the
generation process killed mid-step (a rerun continues exactly), and a 200-step soak of memory and
shared memory."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from disa_jax import models, testing
from disa_jax.rewards.graded import Graded
from disa_jax.rl.collect import grade
from disa_jax.rl.metrics import read_jsonl
from disa_jax.rl.prompts import PromptItem
from disa_jax.rollout import shm
from disa_jax.rollout.types import Completion
from tests.rl import test_trainer as tt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "rl", "stage3_worker.py")


def _completion(ids):
  ids = np.asarray(ids, np.int32)
  return Completion(token_ids=ids, logprobs=np.zeros(ids.shape, np.float32), raw_logprobs=None,
                    finish_reason="stop")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_reward_is_refused_naming_the_prompt(bad):
  items = [PromptItem("q0", (5, 6), {}), PromptItem("q7", (5, 7), {})]
  comps = [[_completion([3]), _completion([4])], [_completion([3]), _completion([4, 4])]]
  reward_fn = lambda responses, metas: Graded([0.0, 1.0, bad, 0.0], [False] * 4)
  with pytest.raises(ValueError, match=rf"1 non-finite reward\(s\), e.g. \[{bad}\] for prompts "
                                       r"\['q7'\]"):
    grade(reward_fn, str, items, comps)
  with pytest.raises(TypeError, match="must return a Graded"):
    grade(lambda r, m: [0.0] * 4, str, items, comps)


def test_a_trainer_without_prompts_is_refused(tmp_path):
  cfg = tt._cfg(steps=1)  # pylint: disable=protected-access
  policy = testing.make_tiny_model(seed=0, **tt.TINY)
  with pytest.raises(ValueError, match="needs at least one prompt, got 0"):
    tt.build_trainer(cfg, str(tmp_path), tt.StepModels(policy, policy, tt._mesh1()),  # pylint: disable=protected-access
                     tt._task(prompts=[]),  # pylint: disable=protected-access
                     tt.EngineLink(tt.RecordingEngine(testing.make_tiny_model(seed=0, **tt.TINY))),
                     tt.AnchorInput(tt._anchor(policy.config.hidden_size)))  # pylint: disable=protected-access


def test_resuming_with_another_model_names_the_parameter(tmp_path):
  trainer, _ = tt._trainer(tt._cfg(steps=1), tmp_path)  # pylint: disable=protected-access
  trainer.save(1)
  trainer.close()
  wider = dict(tt.TINY, intermediate_size=96)
  orig = tt.TINY
  try:
    tt.TINY = wider
    with pytest.raises(ValueError, match=r"checkpoint 1 was written with parameter \['layers'\]\['down_kernel'\] "
                                         r"of shape \[1, 64, 32\], this run's model has \[1, 96, 32\]"):
      tt._trainer(tt._cfg(steps=2), tmp_path)  # pylint: disable=protected-access
  finally:
    tt.TINY = orig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("stage3_model"))
  models.save_pretrained(testing.make_tiny_model(seed=0, **tt.TINY), path)
  return path


def _env():
  return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="")


def _start(workdir, steps, model_dir, env, *extra):
  return subprocess.Popen([sys.executable, WORKER, str(workdir), str(steps), model_dir, *extra],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _strip(rows):
  return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
          for r in rows]


@pytest.mark.slow
def test_generation_process_killed_mid_step_then_rerun_continues_exactly(tmp_path, model_dir):
  steps, env = 6, _env()
  ref = _start(tmp_path / "ref", steps, model_dir, env)
  out, _ = ref.communicate(timeout=600)
  assert ref.returncode == 0, out[-3000:]
  expected = read_jsonl(str(tmp_path / "ref" / "metrics.jsonl"))

  work = tmp_path / "killed"
  proc = _start(work, steps, model_dir, env)
  engine_pid = int(proc.stdout.readline().split()[1])
  deadline = time.time() + 600
  while not (work / "metrics.jsonl").exists() or len(read_jsonl(str(work / "metrics.jsonl"))) < 3:
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
    time.sleep(0.01)
  os.kill(engine_pid, signal.SIGKILL)  # mid-run: the trainer is in step 4's rollout or update
  t_kill = time.time()
  out, _ = proc.communicate(timeout=120)
  reported_s = time.time() - t_kill
  assert proc.returncode != 0 and "GenerationProcessError" in out and "died" in out, out[-3000:]
  assert reported_s < 30.0, f"the trainer took {reported_s:.1f} s to report the dead engine"
  done = len(read_jsonl(str(work / "metrics.jsonl")))
  assert 3 <= done < steps
  assert not shm.list_segments(proc.pid)  # the dead run left no shared memory behind

  rerun = _start(work, steps, model_dir, env)
  out, _ = rerun.communicate(timeout=600)
  assert rerun.returncode == 0, out[-3000:]
  assert _strip(read_jsonl(str(work / "metrics.jsonl"))) == _strip(expected)


@pytest.mark.slow
def test_soak_200_steps_memory_and_shared_memory_stay_flat(tmp_path, model_dir):
  """RSS of the trainer and the generation process and /dev/shm at step 10 (after every shape is
  compiled) and step 200: growth under 5%, and no segment remains after the run."""
  proc = _start(tmp_path / "soak", 200, model_dir, _env(), "--soak")
  out, _ = proc.communicate(timeout=1500)
  assert proc.returncode == 0, out[-3000:]
  rows = [r for r in read_jsonl(str(tmp_path / "soak" / "metrics.jsonl")) if "soak/rss_engine_mb" in r]
  first, last = rows[0], rows[-1]
  assert (first["step"], last["step"]) == (10, 200)
  print("\nsoak (MB) step 10 -> 200: " + ", ".join(
      f"{k[5:]} {first[k]:.1f} -> {last[k]:.1f}" for k in sorted(first) if k.startswith("soak/")))
  # (/dev/shm's usage is machine-wide and only printed)
  for key in ("soak/rss_trainer_mb", "soak/rss_engine_mb", "soak/shm_mapped_trainer_mb",
              "soak/shm_mapped_engine_mb"):
    assert last[key] <= 1.05 * first[key], (key, first[key], last[key])
  # the rings (16 + 4 x 32 MiB by default) were mapped by both processes while the engine ran
  assert first["soak/shm_mapped_trainer_mb"] >= 144 and first["soak/shm_mapped_engine_mb"] >= 144
  assert not shm.list_segments(proc.pid)


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "asynchronous"])
def test_the_last_line_names_how_the_generation_process_died(tmp_path, model_dir, staleness):
  """kill -9 of the generation process mid-run: the trainer's last line names its exit code and
  signal, in the synchronous loop and with rollouts one batch ahead (where a push, not the
  sampling after it, may be the call that finds it dead)."""
  work = tmp_path / "run"
  proc = _start(work, 40, model_dir, _env(), "--staleness", str(staleness))
  engine_pid = int(proc.stdout.readline().split()[1])
  deadline = time.monotonic() + 600
  while not (work / "metrics.jsonl").exists() or len(read_jsonl(str(work / "metrics.jsonl"))) < 2:
    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
    time.sleep(0.01)
  os.kill(engine_pid, signal.SIGKILL)
  out, _ = proc.communicate(timeout=120)
  last = [line for line in out.splitlines() if line.strip()][-1]
  assert proc.returncode != 0 and "GenerationProcessError" in last, out[-3000:]
  assert f"(pid {engine_pid}) died with exit code -9 (SIGKILL)" in last, last
