"""A process of a multi-process run lost (SIGKILL, SIGSTOP, an uncaught error): the others stop in
seconds with one line naming it (`disa_jax.parallel.peer_watch`), and a run whose processes all
end normally is not stopped. Two CPU processes through ``launch/multihost.py`` and an entry module
that meets in an all-gather twenty times a second (`mh_collectives`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disa_jax import testing
from disa_jax.parallel import peer_watch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _start(tmp_path, **env_extra):
  port = testing.free_port()
  base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  procs = []
  for pid in range(2):
    env = dict(base, DISA_COORDINATOR=f"localhost:{port}", DISA_NUM_PROCESSES="2",
               DISA_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
               DISA_TEST_STOP=str(tmp_path / "stop"), **env_extra)
    procs.append(subprocess.Popen(
        [sys.executable, "launch/multihost.py", "tests.multihost.mh_collectives"], cwd=ROOT,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  pids = []
  for p in procs:
    line = [""]
    while line[:1] != ["ready"]:  # (Gloo prints its connections first)
      line = p.stdout.readline().split() or [""]
      assert line != [""] or p.poll() is None, p.stderr.read()[-3000:]
    pids.append(int(line[1]))
  return procs, pids


def _stop_all(procs):
  for p in procs:
    if p.poll() is None:
      p.kill()
    p.communicate()


@pytest.mark.parametrize("lost", [1, 0], ids=["a-worker", "the-coordinator"])
def test_a_killed_process_is_named_by_the_survivor_within_seconds(tmp_path, lost):
  procs, pids = _start(tmp_path)
  try:
    os.kill(procs[lost].pid, signal.SIGKILL)
    t0 = time.monotonic()
    survivor = procs[1 - lost]
    _, err = survivor.communicate(timeout=60)
    took = time.monotonic() - t0
  finally:
    _stop_all(procs)
  print(f"process {lost} SIGKILLed: process {1 - lost} exited after {took:.1f} s")  # (docs/cluster.md)
  lines = [l for l in err.splitlines() if l.startswith("error: ")]
  assert survivor.returncode == peer_watch.EXIT_CODE, err[-3000:]
  assert took <= 20.0, f"the survivor took {took:.1f} s"
  assert len(lines) == 1 and lines[0].startswith(
      f"error: process {lost} of 2 (host {os.uname().nodename}, pid {pids[lost]}) is lost: its "
      "connection closed"), err[-3000:]
  assert err.rstrip().endswith(lines[0]), err[-3000:]  # the last line


def test_a_hung_process_is_named_after_the_heartbeat_timeout(tmp_path):
  procs, pids = _start(tmp_path, **{peer_watch.ENV: "4"})
  try:
    os.kill(procs[1].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    _, err = procs[0].communicate(timeout=60)
    took = time.monotonic() - t0
  finally:
    os.kill(procs[1].pid, signal.SIGCONT)
    _stop_all(procs)
  print(f"process 1 stopped (SIGSTOP), timeout 4 s: process 0 exited after {took:.1f} s")
  assert procs[0].returncode == peer_watch.EXIT_CODE, err[-3000:]
  assert 2.5 <= took <= 15.0, took  # silence counts from the last byte heard (<= 1 s before)
  assert err.rstrip().splitlines()[-1].startswith(
      f"error: process 1 of 2 (host {os.uname().nodename}, pid {pids[1]}) is lost: nothing heard "
      "from it for 4."), err[-3000:]


def test_a_process_stopped_by_an_error_is_named_by_the_others(tmp_path):
  procs, pids = _start(tmp_path, DISA_TEST_FAIL_PROCESS="1")
  try:
    _, err = procs[0].communicate(timeout=60)
  finally:
    _stop_all(procs)
  assert procs[0].returncode == peer_watch.EXIT_CODE, err[-3000:]
  assert err.rstrip().splitlines()[-1].startswith(
      f"error: process 1 of 2 (host {os.uname().nodename}, pid {pids[1]}) is lost: its program "
      "stopped with an error"), err[-3000:]


def test_processes_that_end_normally_are_not_stopped(tmp_path):
  procs, _ = _start(tmp_path)
  try:
    (tmp_path / "stop").write_text("")
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    _stop_all(procs)
  for p, (out, err) in zip(procs, outs):
    assert p.returncode == 0 and out.rstrip().endswith("done") and "error: " not in err, err[-3000:]
