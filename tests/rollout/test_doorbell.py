"""The shared-memory rings' doorbell: waiters sleep on a counter word until a writer rings it."""
import multiprocessing as mp
import sys
import threading
import time

import numpy as np
import pytest

from disa_jax.rollout import doorbell, shm

pytestmark = pytest.mark.skipif(doorbell._FUTEX is None, reason="no futex on this machine")  # pylint: disable=protected-access


def _no_polls(i):
  raise AssertionError(f"polled ({i}) instead of sleeping on the doorbell")


def test_a_wait_on_a_moved_counter_returns_at_once_and_a_ring_wakes_a_sleeper(monkeypatch):
  monkeypatch.setattr(doorbell, "sleep_backoff", _no_polls)
  bell = doorbell.Doorbell(np.zeros(1, np.uint32))
  t0 = time.monotonic()
  bell.wait(bell.value() + 1, timeout=30.0)  # the counter is not what the caller saw
  assert time.monotonic() - t0 < 5.0
  seen = bell.value()
  threading.Timer(0.2, bell.ring).start()
  t0 = time.monotonic()
  bell.wait(seen, timeout=30.0)
  assert 0.1 < time.monotonic() - t0 < 10.0 and bell.value() == seen + 1
  t0 = time.monotonic()
  bell.wait(bell.value(), timeout=0.1)  # nobody rings: the timeout
  assert time.monotonic() - t0 >= 0.09


def test_the_counter_wraps_and_a_bad_word_is_refused():
  bell = doorbell.Doorbell(np.full(1, 2 ** 32 - 1, np.uint32))
  bell.ring()
  assert bell.value() == 0
  with pytest.raises(ValueError, match="one aligned uint32, got int64"):
    doorbell.Doorbell(np.zeros(1, np.int64))


def _put_later(name, delay):
  ring = shm.ShmRing.attach(name)
  time.sleep(delay)
  ring.put({"from": "child"})
  ring.close()


def test_a_ring_reader_in_another_process_sleeps_until_the_put(monkeypatch):
  """The reader's wait never polls: it sleeps on the doorbell, waking only for its 50 ms liveness
  checks, until the other process's put rings it. (The header lock's own back-off, for the
  microseconds another process holds it, may poll.)"""
  polls = []
  backoff = doorbell.sleep_backoff
  monkeypatch.setattr(doorbell, "sleep_backoff", lambda i: polls.append(
      sys._getframe(1).f_code.co_name) or backoff(i))  # pylint: disable=protected-access
  ring = shm.ShmRing.create(shm.segment_name("bell"), num_slots=2, slot_bytes=4096)
  waits = []
  wait = doorbell.Doorbell.wait
  monkeypatch.setattr(doorbell.Doorbell, "wait", lambda self, *a: waits.append(a) or wait(self, *a))
  proc = mp.get_context("spawn").Process(target=_put_later, args=(ring.name, 0.5))
  try:
    proc.start()
    t0 = time.monotonic()
    assert ring.get(timeout=60, check=lambda: None)[0] == {"from": "child"}
    waited = time.monotonic() - t0  # the child's start (seconds on a loaded machine) + 0.5 s
    proc.join(30)
    assert proc.exitcode == 0
  finally:
    if proc.is_alive():
      proc.kill()
    ring.close()
  # one wake-up per 50 ms liveness check, and one for the put; the polls before slept at most
  # 1 ms each (~1,000 a second)
  assert 5 <= len(waits) <= waited / 0.05 + 10, (len(waits), waited)
  assert set(polls) <= {"_locked"}, polls


def test_without_futex_the_ring_polls_as_before(monkeypatch):
  monkeypatch.setattr(doorbell, "_FUTEX", None)
  polls = []
  backoff = doorbell.sleep_backoff
  monkeypatch.setattr(doorbell, "sleep_backoff", lambda i: polls.append(i) or backoff(i))
  ring = shm.ShmRing.create(shm.segment_name("poll"), num_slots=2, slot_bytes=4096)
  try:
    threading.Timer(0.1, lambda: ring.put({"k": 1})).start()
    assert ring.get(timeout=30)[0] == {"k": 1}
  finally:
    ring.close()
  assert len(polls) > 20  # yields, then sleeps growing to 1 ms
