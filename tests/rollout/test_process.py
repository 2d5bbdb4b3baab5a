"""The generation process: a JAX engine behind `RemoteEngine`, and every failure path."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from disa_jax.rollout import (GenerationProcessError, ProcessOptions, RemoteEngine, SamplingParams,
                              flat_weights, make_engine, process, shm)
from disa_jax import codec
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.rollout.process import spawn_environment
from tests.rollout import reference

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 30, 40, 50, 60, 70]]
PARAMS = SamplingParams(n=4, temperature=0.9, top_p=0.95, max_tokens=16, seed=3,
                        return_raw_logprobs=True)


def _wait_for(pred, timeout, what):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if pred():
      return
    time.sleep(0.05)
  raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def _maps_segment(pid, prefix):
  """True if process `pid`, a spawned (exec'd) worker, has a /dev/shm segment named `prefix`* mapped.

  Between fork and exec a child's maps are a copy of its parent's, the trainer's segments included;
  such a child has mapped nothing itself. Its command line is still the parent's, so it is read first:
  once it names `spawn_main`, the maps read after it are the worker's own.
  """
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      if b"spawn_main" not in f.read():
        return False
    with open(f"/proc/{pid}/maps") as f:
      return any(f"/dev/shm/{prefix}" in line for line in f)
  except OSError:
    return False


def _children(pid):
  kids = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        with open(f"/proc/{entry}/stat") as f:
          fields = f.read().split(")")[-1].split()
      except OSError:
        continue
      if int(fields[1]) == pid:
        kids.append(int(entry))
  return kids


@pytest.fixture(scope="module")
def remote(tiny_ckpt):
  # Small result slots so that results travel in several chunks; weights copied by two threads.
  process = ProcessOptions(result_bytes=8192, heartbeat_timeout_s=30.0, copy_threads=2)
  with make_engine("jax", tiny_ckpt, process=process) as engine:
    yield engine


def test_remote_matches_in_process_and_leaves_no_names(remote, tiny_ckpt, hf_state):
  assert isinstance(remote, RemoteEngine) and remote.startup_s > 0
  assert shm.list_segments(os.getpid()) == []  # unlinked once both sides mapped them
  local = JaxSampler.from_pretrained(tiny_ckpt)
  got, want = remote.generate(PROMPTS, PARAMS), local.generate(PROMPTS, PARAMS)
  assert [len(x) for x in got] == [PARAMS.n] * len(PROMPTS)
  # The worker's own engine seconds, inside the call's (results came in several chunks)
  timing = remote.last_generate
  assert 0 < timing["engine_s"] < timing["total_s"], timing
  for pg, pw in zip(got, want):
    for a, b in zip(pg, pw):
      np.testing.assert_array_equal(a.token_ids, b.token_ids)
      np.testing.assert_array_equal(a.logprobs, b.logprobs)
      np.testing.assert_array_equal(a.raw_logprobs, b.raw_logprobs)
      assert a.finish_reason == b.finish_reason
  assert remote.ping() == remote.pid


def test_remote_weight_update_changes_and_restores(remote, hf_state):
  reference.check_update_changes_and_restores(remote, PROMPTS, PARAMS, hf_state, seed=1)
  assert shm.list_segments(os.getpid()) == []


def test_remote_flat_push_equals_direct_load(remote, tiny_model, hf_state, monkeypatch):
  """A flat push through shared memory (several buckets, each copied by two threads) changes the
  samples, and pushing the checkpoint's weights back samples bit for bit as before (the worker
  loaded the checkpoint directly)."""
  copies = []  # (bytes, threads that copied) of each array written into shared memory
  copy_array = shm.copy_array
  monkeypatch.setattr(shm, "copy_array", lambda dst, src, *a: copies.append(
      (src.nbytes, copy_array(dst, src, *a))))
  assert remote.copy_threads == 2  # ProcessOptions.copy_threads
  monkeypatch.setattr(remote, "copy_min_bytes", 0)  # the tiny model's buckets are < 4 MiB
  push = lambda state: reference.flat_push(state, tiny_model.config, bucket_bytes=100_000)
  buckets = [b.nbytes for b in push(hf_state).buffers]
  assert len(buckets) > 2
  reference.check_update_changes_and_restores(remote, PROMPTS, PARAMS, hf_state, seed=2,
                                              push=push)
  assert remote.last_sync["bytes"] >= push(hf_state).nbytes
  # Each of the two pushes copied every bucket with two threads (the rest: generate requests).
  assert sorted(n for n, t in copies if t == 2) == sorted(buckets * 2), copies
  assert shm.list_segments(os.getpid()) == []


def test_a_push_with_another_layout_is_decoded_anew(remote, tiny_model, hf_state):
  """The worker decodes a flat push's layout once while it stays the same (as the trainer encodes
  it once, `_encoded_layout`); a push laid out otherwise (one bucket, then several) loads by its
  own layout: restoring the weights samples bit for bit as before."""
  sizes = iter([0, 100_000])
  push = lambda state: reference.flat_push(state, tiny_model.config, bucket_bytes=next(sizes))
  reference.check_update_changes_and_restores(remote, PROMPTS, PARAMS, hf_state, seed=3,
                                              push=push)
  layout = reference.flat_push(hf_state, tiny_model.config, bucket_bytes=0).layout
  again = flat_weights.FlatLayout(layout.config, layout.dtype, layout.bucket_bytes)
  assert process._encoded_layout(again) is process._encoded_layout(layout)  # pylint: disable=protected-access
  assert process._encoded_layout(layout) == codec.encode(layout)  # pylint: disable=protected-access


def test_a_wall_clock_step_does_not_stop_a_healthy_generation_process(remote, monkeypatch):
  """An NTP step of the wall clock (here 120 s forward, as the trainer sees it, 4x the fixture's
  heartbeat_timeout_s) leaves the heartbeat alone: it runs on the monotonic clock."""
  wall = time.time
  monkeypatch.setattr(time, "time", lambda: wall() + 120.0)
  for _ in range(3):  # each call waits for the worker, reading its heartbeat
    assert [len(g) for g in remote.generate(PROMPTS, PARAMS)] == [PARAMS.n] * len(PROMPTS)


def test_worker_errors_are_reported_and_engine_survives(remote, hf_state):
  with pytest.raises(GenerationProcessError, match="outside"):
    remote.generate([[1, 100_000]], PARAMS)
  with pytest.raises(GenerationProcessError, match="layers.0"):
    remote.update_weights({k: v for k, v in hf_state.items() if "layers.0." not in k})
  assert shm.list_segments(os.getpid()) == []  # a failed push leaves no name behind either
  assert len(remote.generate(PROMPTS[:1], PARAMS)[0]) == PARAMS.n


def test_startup_failure_is_reported(tmp_path):
  with pytest.raises(GenerationProcessError, match="failed to start"):
    RemoteEngine("jax", str(tmp_path / "missing"), process=ProcessOptions(startup_timeout_s=120))
  assert shm.list_segments(os.getpid()) == []


def _start_environment(pid: int) -> dict[str, str]:
  """The environment process ``pid`` was exec'd with (/proc/<pid>/environ: later changes to its
  ``os.environ`` do not show there)."""
  with open(f"/proc/{pid}/environ", "rb") as f:
    items = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
  return {k.decode(): v.decode() for k, v in items}


def test_the_generation_process_starts_with_its_env(tiny_ckpt, monkeypatch):
  """`ProcessOptions.env` is in the generation process's environment from its exec, so before it
  imports anything (JAX reads JAX_PLATFORMS and XLA_FLAGS when imported or initialised there); the
  trainer's own environment is left as it was."""
  monkeypatch.setenv("DISA_TEST_OVERRIDDEN", "trainer")
  monkeypatch.delenv("DISA_TEST_ADDED", raising=False)
  before = dict(os.environ)
  env = {"JAX_PLATFORMS": "cpu", "DISA_TEST_ADDED": "1", "DISA_TEST_OVERRIDDEN": "worker"}
  with make_engine("jax", tiny_ckpt, process=ProcessOptions(env=env)) as engine:
    assert dict(os.environ) == before
    start = _start_environment(engine.pid)
    assert {k: start.get(k) for k in env} == env
    assert len(engine.generate(PROMPTS[:1], PARAMS)[0]) == PARAMS.n


def test_spawn_environment_restores_the_environment(monkeypatch):
  monkeypatch.setenv("DISA_TEST_OVERRIDDEN", "before")
  monkeypatch.delenv("DISA_TEST_ADDED", raising=False)
  with pytest.raises(RuntimeError, match="inside"):
    with spawn_environment({"DISA_TEST_OVERRIDDEN": "x", "DISA_TEST_ADDED": "y"}):
      assert os.environ["DISA_TEST_OVERRIDDEN"] == "x" and os.environ["DISA_TEST_ADDED"] == "y"
      raise RuntimeError("inside")
  assert os.environ["DISA_TEST_OVERRIDDEN"] == "before" and "DISA_TEST_ADDED" not in os.environ
  with pytest.raises(TypeError, match="'N': 1"):
    with spawn_environment({"N": 1}):
      pass


def test_kill_9_of_generation_process(tiny_ckpt):
  engine = make_engine("jax", tiny_ckpt)
  pid = engine.pid
  os.kill(pid, signal.SIGKILL)
  t0 = time.monotonic()
  with pytest.raises(GenerationProcessError, match="died"):
    engine.generate(PROMPTS, PARAMS)
  assert time.monotonic() - t0 < 5.0
  assert shm.list_segments(os.getpid()) == []
  with pytest.raises(GenerationProcessError, match="closed"):
    engine.generate(PROMPTS, PARAMS)
  engine.close()


def test_hung_generation_process_times_out(tiny_ckpt):
  engine = make_engine("jax", tiny_ckpt, process=ProcessOptions(heartbeat_timeout_s=1.5))
  pid = engine.pid
  os.kill(pid, signal.SIGSTOP)
  try:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="hung"):
      engine.generate(PROMPTS, PARAMS)
    # 1.5 s without a heartbeat; the bound leaves room for a loaded CI machine, while the call's
    # own timeout (timeout_s, minutes) would exceed it
    assert time.monotonic() - t0 < 30.0
    _wait_for(lambda: not _alive(pid), 30, "the hung worker to be killed")
  finally:
    if _alive(pid):
      os.kill(pid, signal.SIGKILL)
  assert shm.list_segments(os.getpid()) == []


_TRAINER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from disa_jax.rollout import make_engine, SamplingParams
    from disa_jax import models
    if __name__ == "__main__":
      print("spawning", flush=True)
      engine = make_engine("jax", sys.argv[1])
      engine.update_weights(models.to_hf_state_dict(models.from_pretrained(sys.argv[1])))
      print("ready", engine.pid, flush=True)
      time.sleep(600)
""")


@pytest.mark.parametrize("when", ["startup", "ready"])
def test_kill_9_of_trainer(tiny_ckpt, tmp_path, when):
  """The trainer dies (during the worker's startup, or once it runs): the worker exits and every
  segment named after the trainer's pid disappears."""
  script = tmp_path / "trainer.py"
  script.write_text(_TRAINER)
  repo_root = pathlib.Path(__file__).resolve().parents[2]
  env = dict(os.environ, PYTHONPATH=str(repo_root))
  proc = subprocess.Popen([sys.executable, str(script), tiny_ckpt], stdout=subprocess.PIPE,
                          env=env, text=True)
  try:
    assert proc.stdout.readline().strip() == "spawning"
    if when == "ready":
      line = proc.stdout.readline().split()
      assert line[0] == "ready", line
    else:
      # Kill while the worker is still starting (its engine is not built yet). The worker must have
      # mapped the control block: before that, the segments are the next engine's to clean up
      # (`cleanup_stale_segments`, tested in test_shm), as no process alive knows them. A child
      # alone is not enough: the first one may be multiprocessing's resource tracker.
      prefix = f"{shm.PREFIX}{proc.pid}_"
      _wait_for(lambda: any(_maps_segment(k, prefix) for k in _children(proc.pid)), 60,
                "the worker to map the trainer's segments")
    kids = _children(proc.pid)
    assert kids
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    # liveness bounds, generous for a loaded machine (the worker polls its parent every 0.1 s)
    _wait_for(lambda: not any(_alive(k) for k in kids), 60, "the worker to exit")
    _wait_for(lambda: not shm.list_segments(proc.pid), 30,
              lambda: f"segments {shm.list_segments(proc.pid)} to be unlinked")
  finally:
    if proc.poll() is None:
      proc.kill()
