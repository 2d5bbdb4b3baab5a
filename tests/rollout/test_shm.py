"""Shared-memory transport: messages, the ring buffer under concurrency, segment lifetime."""

import fcntl
import multiprocessing as mp
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from disa_jax.rollout import shm


@pytest.fixture
def ring():
  r = shm.ShmRing.create(shm.segment_name("test"), num_slots=3, slot_bytes=1 << 16)
  yield r
  r.close()


def test_pack_unpack_roundtrip_zero_copy():
  buf = memoryview(bytearray(1 << 16))
  arrays = {"a": np.arange(12, dtype=np.int32).reshape(3, 4),
            "b": np.linspace(0, 1, 7, dtype=np.float32),
            "c": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
            "empty": np.zeros((0, 5), np.int64)}
  used = shm.pack_message(buf, {"x": [1, 2], "s": "hi"}, arrays)
  assert used == shm.message_nbytes({"x": [1, 2], "s": "hi"}, arrays)
  meta, out = shm.unpack_message(buf)
  assert meta == {"x": [1, 2], "s": "hi"}
  for k, v in arrays.items():
    assert out[k].dtype == v.dtype and out[k].shape == v.shape
    np.testing.assert_array_equal(out[k], v)
  out["a"][0, 0] = 99  # a view into the buffer, not a copy
  assert shm.unpack_message(buf)[1]["a"][0, 0] == 99


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_threaded_copy_equals_plain_copy_bitwise(threads):
  """`copy_array` with several threads writes the same bytes as ``dst[...] = src``: odd sizes
  (below, at and just above a thread's 64-byte cut, and with more threads than 64-byte blocks),
  2-byte bfloat16 and 4-byte elements, source and destination at unaligned addresses."""
  rng = np.random.default_rng(threads)
  raw = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
  for dtype in (np.uint8, ml_dtypes.bfloat16, np.float32):
    itemsize = np.dtype(dtype).itemsize
    for n in (1, 3, 63, 64, 65, 127, 191, 1000, 4097, 12345):
      nbytes = n * itemsize
      src = raw[1:1 + nbytes].view(dtype)  # starts at an odd address
      plain = np.empty(nbytes, np.uint8)
      plain.view(dtype)[...] = src
      threaded = np.full(nbytes + 6, 0xAB, np.uint8)  # the copy goes to [3, 3 + nbytes)
      assert shm.copy_array(threaded[3:3 + nbytes].view(dtype), src, threads, min_bytes=0) == threads
      np.testing.assert_array_equal(threaded[3:3 + nbytes], plain,
                                    err_msg=f"{np.dtype(dtype)}[{n}], {threads} threads")
      assert (threaded[:3] == 0xAB).all() and (threaded[-3:] == 0xAB).all()  # nothing outside
  big = raw[:1 << 15]
  out = np.zeros_like(big)
  assert shm.copy_array(out, big, threads, min_bytes=1 << 16) == 1  # below min_bytes: one thread
  assert shm.copy_array(out[::2], big[::2], threads, min_bytes=0) == 1  # not contiguous
  np.testing.assert_array_equal(out[::2], big[::2])


def test_message_too_large_names_sizes(ring):
  with pytest.raises(ValueError, match="exceeds ShmRing"):
    ring.put({}, {"x": np.zeros(1 << 15, np.float32)})
  with pytest.raises(ValueError, match="does not fit"):
    shm.pack_message(memoryview(bytearray(100)), {}, {"x": np.zeros(100)})


def test_fifo_and_timeouts(ring):
  for i in range(3):
    ring.put({"i": i}, {"v": np.full(4, i)})
  with pytest.raises(TimeoutError, match="no free slot"):
    ring.put({"i": 3}, timeout=0.05)
  assert ring.pending() == 3
  got = [ring.get(timeout=1)[0]["i"] for _ in range(3)]
  assert got == [0, 1, 2]
  with pytest.raises(TimeoutError, match="no ready slot"):
    ring.get(timeout=0.05)

  def dead():
    raise shm.RingClosed("peer gone")

  with pytest.raises(shm.RingClosed):
    ring.get(timeout=5, check=dead)


def test_read_view_holds_slot_until_released():
  r = shm.ShmRing.create(shm.segment_name("test"), num_slots=1, slot_bytes=4096)
  try:
    r.put({"k": 1}, {"v": np.arange(5)})
    with r.read(timeout=1) as (meta, arrays):
      np.testing.assert_array_equal(arrays["v"], np.arange(5))
      with pytest.raises(TimeoutError):  # the only slot is being read
        r.put({"k": 2}, timeout=0.05)
    r.put({"k": 2}, timeout=0.05)
    assert r.get(timeout=1)[0] == {"k": 2}
  finally:
    r.close()


def test_concurrent_threads_round_trip(ring):
  n_producers, n_items = 3, 60
  received, lock = [], threading.Lock()

  def produce(pid):
    for i in range(n_items):
      ring.put({"p": pid, "i": i}, {"v": np.full(i + 1, pid * 1000 + i, np.int64)}, timeout=30)

  def consume():
    while True:
      meta, arrays = ring.get(timeout=30)
      if meta.get("stop"):
        return
      assert arrays["v"].shape == (meta["i"] + 1,)
      assert np.all(arrays["v"] == meta["p"] * 1000 + meta["i"])
      with lock:
        received.append((meta["p"], meta["i"]))

  consumers = [threading.Thread(target=consume) for _ in range(2)]
  producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
  for t in consumers + producers:
    t.start()
  for t in producers:
    t.join()
  for _ in consumers:
    ring.put({"stop": True}, timeout=30)
  for t in consumers:
    t.join()
  assert sorted(received) == [(p, i) for p in range(n_producers) for i in range(n_items)]


def _proc_producer(name, pid, n_items):
  r = shm.ShmRing.attach(name)
  for i in range(n_items):
    r.put({"p": pid, "i": i}, {"v": np.full(2 * i + 1, pid * 1000 + i, np.int32)}, timeout=60)
  r.close()


def _proc_consumer(name, out_name, n_total):
  r = shm.ShmRing.attach(name)
  out = shm.ShmRing.attach(out_name)
  seen = []
  for _ in range(n_total):
    meta, arrays = r.get(timeout=60)
    ok = bool(np.all(arrays["v"] == meta["p"] * 1000 + meta["i"]))
    seen.append([meta["p"], meta["i"], int(ok)])
  out.put({"seen": seen}, timeout=60)
  r.close()
  out.close()


@pytest.mark.slow
def test_concurrent_processes_round_trip(ring):
  """2 producer processes and 2 consumer processes through one 3-slot ring."""
  out = shm.ShmRing.create(shm.segment_name("out"), num_slots=2, slot_bytes=1 << 16)
  ctx = mp.get_context("spawn")
  n_items = 40
  procs = [ctx.Process(target=_proc_producer, args=(ring.name, p, n_items)) for p in range(2)]
  procs += [ctx.Process(target=_proc_consumer, args=(ring.name, out.name, n_items))
            for _ in range(2)]
  try:
    for p in procs:
      p.start()
    seen = out.get(timeout=120)[0]["seen"] + out.get(timeout=120)[0]["seen"]
    for p in procs:
      p.join(30)
      assert p.exitcode == 0
  finally:
    for p in procs:
      if p.is_alive():
        p.kill()
    out.close()
  assert all(ok for _, _, ok in seen)
  assert sorted((p, i) for p, i, _ in seen) == [(p, i) for p in range(2) for i in range(n_items)]
  # Each producer's messages arrive in order at each consumer.
  for p in range(2):
    for c in range(2):
      chunk = seen[c * n_items:(c + 1) * n_items]
      order = [i for q, i, _ in chunk if q == p]
      assert order == sorted(order)


def test_killed_lock_holder_does_not_wedge_ring(ring):
  """flock is released by the kernel when a holder dies (here: a child killed mid-critical-section)."""
  ctx = mp.get_context("spawn")
  held = ctx.Event()
  proc = ctx.Process(target=_hold_lock_forever, args=(ring.name, held))
  proc.start()
  try:
    assert held.wait(120), "the child never took the lock"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="lock"):  # the lock is held: put times out
      ring.put({"x": 1}, timeout=0.2)
    assert time.monotonic() - t0 < 2.0
    proc.kill()
    proc.join(10)
    ring.put({"ok": 1}, timeout=5)
    assert ring.get(timeout=5)[0] == {"ok": 1}
  finally:
    if proc.is_alive():
      proc.kill()


class _PeerHung(Exception):
  pass


def test_a_stopped_lock_holder_is_reported_by_the_liveness_check(ring):
  """A peer stopped (SIGSTOP, a hung process) while holding the header lock: put and get with a
  long timeout still run their `check` while waiting for the lock, so the caller's liveness check
  reports it at once instead of blocking for the whole timeout."""
  other = shm.ShmRing.attach(ring.name)  # its own open file: its flock excludes ours
  fcntl.flock(other._shm._fd, fcntl.LOCK_EX)  # pylint: disable=protected-access
  calls = []

  def check():
    calls.append(time.monotonic())
    if len(calls) >= 3:
      raise _PeerHung("generation process hung")

  try:
    for op in (lambda: ring.put({"x": 1}, timeout=3600, check=check),
               lambda: ring.get(timeout=3600, check=check)):
      calls.clear()
      t0 = time.monotonic()
      with pytest.raises(_PeerHung):
        op()
      assert time.monotonic() - t0 < 5.0 and len(calls) == 3
  finally:
    fcntl.flock(other._shm._fd, fcntl.LOCK_UN)  # pylint: disable=protected-access
    other.close()
  ring.put({"ok": 1}, timeout=5)  # the lock was released by the failed waits too
  assert ring.get(timeout=5)[0] == {"ok": 1}


def _hold_lock_forever(name, held):
  import fcntl
  r = shm.ShmRing.attach(name)
  fcntl.flock(r._shm._fd, fcntl.LOCK_EX)  # pylint: disable=protected-access
  held.set()
  time.sleep(600)


def test_stale_segments_of_dead_creators_are_removed():
  proc = mp.get_context("spawn").Process(target=time.sleep, args=(0,))
  proc.start()
  proc.join()
  name = shm.segment_name("stale", pid=proc.pid)
  seg = shm.open_segment(name, 128, create=True)
  shm.close_segment(seg)
  live = shm.ShmBlock.create(shm.segment_name("live"), 128)
  try:
    assert name in shm.list_segments()
    removed = shm.cleanup_stale_segments()
    assert name in removed and name not in shm.list_segments()
    assert live.name in shm.list_segments()  # our own pid is alive
  finally:
    live.close()
  assert live.name not in shm.list_segments()
  with pytest.raises(ValueError, match="role"):
    shm.segment_name("Bad-Role")
