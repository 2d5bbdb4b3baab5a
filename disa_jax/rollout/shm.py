"""Shared-memory transport between the trainer and the generation process.

Three pieces, all on `multiprocessing.shared_memory` segments:

* `pack_message` / `unpack_message`: a message is a small JSON header plus named NumPy arrays laid out
  at 64-byte aligned offsets; unpacking returns zero-copy views into the segment.
* `ShmRing`: a ring of fixed-size slots with a header holding, per slot, its state, a sequence number
  and the payload length. Any number of producers and consumers (threads or processes) may use it.
  The header is guarded by an in-process `threading.Lock` plus an `fcntl.flock` on the segment's file
  descriptor, which the kernel releases when a process dies, so a `kill -9` never leaves the ring
  locked. Payloads are copied outside the lock (slot states WRITING / READING). A waiter sleeps
  on the ring's `doorbell.Doorbell`, which every change a waiter may want rings, with a deadline
  and an optional liveness check at least every 50 ms, so no wait can hang forever.
* `ShmBlock`: one segment holding one message (used for weights, rewritten in place each update).

Lifetime. Segments are created with names `disa_ro_<creator pid>_<token>_<role>` and are not tracked
by Python's resource tracker (this module manages them). The generation-process protocol unlinks each
name as soon as both sides have it mapped, so from then on nothing can leak; the short windows before
that are covered by watchdogs on both sides and by `cleanup_stale_segments`, which removes segments
whose creator pid is no longer alive.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import json
import os
import re
import secrets
import threading
import time
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable, Iterator, Mapping

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. so np.dtype('bfloat16') works)
import numpy as np

from disa_jax.rollout import doorbell

try:  # POSIX only; used to unlink names that the resource tracker does not know about.
  import _posixshmem  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover
  _posixshmem = None

PREFIX = "disa_ro_"
_ALIGN = 64
MIN_THREADED_BYTES = 1 << 22  # default of `copy_array`'s min_bytes: smaller arrays, one thread
_SHM_DIR = "/dev/shm"


def _align(n: int) -> int:
  return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def segment_name(role: str, token: str | None = None, pid: int | None = None) -> str:
  """Returns `disa_ro_<pid>_<token>_<role>`; the pid lets a survivor find a dead creator's segments."""
  if not re.fullmatch(r"[a-z0-9]+", role):
    raise ValueError(f"segment role must be [a-z0-9]+, got {role!r}")
  token = token or secrets.token_hex(4)
  return f"{PREFIX}{os.getpid() if pid is None else pid}_{token}_{role}"


def open_segment(name: str, size: int = 0, create: bool = False) -> shared_memory.SharedMemory:
  """Creates or attaches a segment that the resource tracker does not manage (see module doc)."""
  if create and size <= 0:
    raise ValueError(f"segment size must be > 0, got {size} for {name!r}")
  shm = shared_memory.SharedMemory(name=name, create=create, size=size)
  # Python registers every open segment with its resource tracker (shared by spawned children), which
  # would unlink it (with warnings) when *any* process exits; lifetime is managed here instead.
  resource_tracker.unregister(shm._name, "shared_memory")  # pylint: disable=protected-access
  return shm


def unlink_segment(name: str) -> bool:
  """Removes a segment name (mappings stay valid); returns False if it did not exist."""
  try:
    if _posixshmem is not None:
      _posixshmem.shm_unlink("/" + name.lstrip("/"))
    else:  # pragma: no cover
      os.unlink(os.path.join(_SHM_DIR, name))
    return True
  except FileNotFoundError:
    return False


def close_segment(shm: shared_memory.SharedMemory) -> None:
  """Unmaps a segment; if NumPy views still reference it, the mapping is freed when they are."""
  try:
    shm.close()
  except BufferError:
    pass


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def list_segments(pid: int | None = None) -> list[str]:
  """Names of this module's segments in /dev/shm (of creator `pid` if given)."""
  if not os.path.isdir(_SHM_DIR):
    return []
  prefix = PREFIX if pid is None else f"{PREFIX}{pid}_"
  return sorted(n for n in os.listdir(_SHM_DIR) if n.startswith(prefix))


def cleanup_stale_segments() -> list[str]:
  """Unlinks segments whose creator pid is dead; returns the removed names."""
  removed = []
  for name in list_segments():
    m = re.match(rf"{PREFIX}(\d+)_", name)
    if m and not _pid_alive(int(m.group(1))) and unlink_segment(name):
      removed.append(name)
  return removed


# ----------------------------------------------------------------------------------------------
# Messages.
# ----------------------------------------------------------------------------------------------


def _layout(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list, int]:
  entries, offset = [], 0
  for name, a in arrays.items():
    a = np.asarray(a)
    if a.dtype.hasobject:
      raise TypeError(f"array {name!r} has object dtype; only plain NumPy dtypes can be shared")
    if a.dtype.byteorder == ">":
      raise TypeError(f"array {name!r} is big-endian ({a.dtype}); convert it first")
    entries.append([name, a.dtype.name, list(a.shape), offset])
    offset = _align(offset + a.nbytes)
  header = json.dumps({"meta": dict(meta), "arrays": entries}).encode()
  return header, entries, offset


def message_nbytes(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> int:
  """Bytes that `pack_message` needs for this message."""
  header, _, data = _layout(meta, arrays)
  return _align(8 + len(header)) + data


def copy_array(dst: np.ndarray, src: np.ndarray, threads: int = 1,
               min_bytes: int = MIN_THREADED_BYTES) -> int:
  """``dst[...] = src``; with ``threads`` > 1, both C-contiguous of the same dtype and shape and
  at least ``min_bytes`` bytes, as byte copies of ``threads`` slices (cut at multiples of 64 bytes)
  run in a thread pool (NumPy releases the GIL for them). Returns the threads that copied (1: the
  calling thread alone)."""
  if (threads <= 1 or dst.dtype != src.dtype or dst.shape != src.shape
      or not (dst.flags.c_contiguous and src.flags.c_contiguous) or src.nbytes < min_bytes):
    dst[...] = src
    return 1
  d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)
  bounds = np.linspace(0, d.size, threads + 1).astype(np.int64) // _ALIGN * _ALIGN
  bounds[-1] = d.size
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    list(pool.map(lambda i: np.copyto(d[bounds[i]:bounds[i + 1]], s[bounds[i]:bounds[i + 1]]),
                  range(threads)))
  return threads


def pack_message(buf: memoryview, meta: Mapping[str, Any],
                 arrays: Mapping[str, np.ndarray], threads: int = 1,
                 min_threaded_bytes: int = MIN_THREADED_BYTES) -> int:
  """Writes `meta` (JSON-able) and `arrays` into `buf`; returns the bytes used.

  Args:
    threads: arrays of at least ``min_threaded_bytes`` are copied by this many threads
      (`copy_array`).

  Raises:
    ValueError: if the message does not fit into `buf` (the error gives both sizes).
  """
  header, entries, data = _layout(meta, arrays)
  base = _align(8 + len(header))
  total = base + data
  if total > len(buf):
    raise ValueError(f"message of {total} bytes does not fit a {len(buf)}-byte slot; "
                     f"increase the slot size (arrays: {[(e[0], e[2]) for e in entries]})")
  buf[:8] = len(header).to_bytes(8, "little")
  buf[8:8 + len(header)] = header
  for (name, dtype, shape, offset), a in zip(entries, arrays.values()):
    a = np.asarray(a)
    dst = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=buf, offset=base + offset)
    copy_array(dst, a, threads, min_threaded_bytes)
  return total


def unpack_message(buf: memoryview) -> tuple[dict, dict[str, np.ndarray]]:
  """Reads a message written by `pack_message`; arrays are zero-copy views into `buf`."""
  n = int.from_bytes(bytes(buf[:8]), "little")
  header = json.loads(bytes(buf[8:8 + n]))
  base = _align(8 + n)
  arrays = {}
  for name, dtype, shape, offset in header["arrays"]:
    arrays[name] = np.ndarray(tuple(shape), dtype=np.dtype(dtype), buffer=buf, offset=base + offset)
  return header["meta"], arrays


# ----------------------------------------------------------------------------------------------
# Ring buffer.
# ----------------------------------------------------------------------------------------------

_MAGIC = 0x44495341524F4E47  # "DISARONG"
_EMPTY, _WRITING, _FULL, _READING = 0, 1, 2, 3
_GLOBAL_FIELDS = 8  # magic, num_slots, slot_bytes, next_seq, puts, gets, doorbell, reserved
_DOORBELL_FIELD = 6  # its first 4 bytes: the `doorbell.Doorbell` word
_SLOT_FIELDS = 4  # state, seq, nbytes, reserved


class RingClosed(RuntimeError):
  """The ring's peer is gone (raised by a liveness check while waiting)."""


class ShmRing:
  """A multi-producer multi-consumer ring of fixed-size message slots in one shared segment.

  Create it in one process (`ShmRing.create`) and attach elsewhere by name (`ShmRing.attach`).
  `put` copies a message into a free slot; `get` copies the oldest ready message out, and `read`
  yields zero-copy views that stay valid until the `with` block ends (the slot is then freed).
  Messages from one producer are delivered in the order they were put.
  """

  lock_timeout_s = 30.0  # the header lock is held for microseconds; waiting longer means a wedge

  def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
    self._shm = shm
    self.name = shm.name
    self._owner = owner
    self._tlock = threading.Lock()
    hdr = np.ndarray((_GLOBAL_FIELDS,), np.int64, buffer=shm.buf)
    if int(hdr[0]) != _MAGIC:
      raise ValueError(f"shared segment {shm.name!r} is not a ShmRing (bad magic)")
    self.num_slots = int(hdr[1])
    self.slot_bytes = int(hdr[2])
    self._glob = hdr
    # Per-slot header fields; reshape the flat int64 block to [num_slots, _SLOT_FIELDS].
    self._slots = np.ndarray((self.num_slots, _SLOT_FIELDS), np.int64, buffer=shm.buf,
                             offset=_GLOBAL_FIELDS * 8)
    self._data_offset = _align((_GLOBAL_FIELDS + _SLOT_FIELDS * self.num_slots) * 8)
    self._bell = doorbell.Doorbell(np.ndarray((1,), np.uint32, buffer=shm.buf,
                                              offset=_DOORBELL_FIELD * 8))

  @classmethod
  def create(cls, name: str, num_slots: int, slot_bytes: int) -> "ShmRing":
    if num_slots < 1 or slot_bytes < 64:
      raise ValueError(f"ShmRing needs num_slots >= 1 and slot_bytes >= 64, "
                       f"got {num_slots}, {slot_bytes}")
    slot_bytes = _align(slot_bytes)
    data_offset = _align((_GLOBAL_FIELDS + _SLOT_FIELDS * num_slots) * 8)
    shm = open_segment(name, data_offset + num_slots * slot_bytes, create=True)
    hdr = np.ndarray((_GLOBAL_FIELDS + _SLOT_FIELDS * num_slots,), np.int64, buffer=shm.buf)
    hdr[:] = 0
    hdr[1], hdr[2] = num_slots, slot_bytes
    hdr[0] = _MAGIC
    return cls(shm, owner=True)

  @classmethod
  def attach(cls, name: str) -> "ShmRing":
    return cls(open_segment(name), owner=False)

  @contextlib.contextmanager
  def _locked(self, timeout: float | None = None,
              check: Callable[[], None] | None = None) -> Iterator[None]:
    """Holds the header lock; polls (non-blocking flock) so that `timeout` is honoured, calling
    `check` every ~50 ms meanwhile (a peer stopped while holding the lock is then reported by the
    caller's liveness check instead of blocking for the whole timeout)."""
    timeout = self.lock_timeout_s if timeout is None else timeout
    deadline = time.monotonic() + timeout
    if not self._tlock.acquire(timeout=timeout):
      raise TimeoutError(f"ShmRing {self.name!r}: header lock not acquired within {timeout} s")
    try:
      i, next_check = 0, time.monotonic() + 0.05
      while True:
        try:
          fcntl.flock(self._shm._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # pylint: disable=protected-access
          break
        except BlockingIOError:
          now = time.monotonic()
          if now >= deadline:
            raise TimeoutError(f"ShmRing {self.name!r}: header lock held by another process for "
                               f"more than {timeout} s") from None
          if check is not None and now >= next_check:
            check()
            next_check = now + 0.05
          doorbell.sleep_backoff(i)  # the lock is held for microseconds: poll
          i += 1
      try:
        yield
      finally:
        fcntl.flock(self._shm._fd, fcntl.LOCK_UN)  # pylint: disable=protected-access
    finally:
      self._tlock.release()

  def _slot_view(self, i: int, nbytes: int | None = None) -> memoryview:
    start = self._data_offset + i * self.slot_bytes
    return self._shm.buf[start:start + (self.slot_bytes if nbytes is None else nbytes)]

  def _claim(self, from_state: int, to_state: int, oldest: bool, timeout: float | None,
             check: Callable[[], None] | None = None) -> int | None:
    with self._locked(timeout, check):
      idx = np.flatnonzero(self._slots[:, 0] == from_state)
      if idx.size == 0:
        return None
      i = int(idx[np.argmin(self._slots[idx, 1])]) if oldest else int(idx[0])
      self._slots[i, 0] = to_state
      if to_state == _WRITING:
        self._slots[i, 1] = self._glob[3]
        self._glob[3] += 1
      return i

  def _set_state(self, i: int, state: int, nbytes: int | None = None) -> None:
    with self._locked():
      if nbytes is not None:
        self._slots[i, 2] = nbytes
      self._slots[i, 0] = state
      if state in (_FULL, _EMPTY):  # a message to read, or a slot to write: wake the waiters
        self._bell.ring()

  def _wait_claim(self, from_state: int, to_state: int, oldest: bool, timeout: float | None,
                  check: Callable[[], None] | None, what: str) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    i = 0
    next_check = time.monotonic() + 0.05
    while True:
      seen = self._bell.value()  # before looking: a change after it ends the wait below at once
      left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
      slot = self._claim(from_state, to_state, oldest, left, check)
      if slot is not None:
        return slot
      now = time.monotonic()
      if deadline is not None and now >= deadline:
        raise TimeoutError(f"ShmRing {self.name!r}: no {what} slot within {timeout} s")
      if check is not None and now >= next_check:
        check()
        next_check = now + 0.05
      nap = min(0.05, next_check - now, 0.05 if deadline is None else deadline - now)
      self._bell.wait(seen, nap, i)
      i += 1

  def put(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray] | None = None, *,
          timeout: float | None = None, check: Callable[[], None] | None = None) -> None:
    """Copies a message into a free slot, waiting up to `timeout` seconds for one.

    Args:
      meta: JSON-serialisable metadata.
      arrays: named NumPy arrays.
      timeout: seconds to wait for a free slot (None: no limit, but `check` still runs).
      check: called every ~50 ms while waiting; raise from it to abort (e.g. peer died).
    """
    arrays = arrays or {}
    nbytes = message_nbytes(meta, arrays)
    if nbytes > self.slot_bytes:
      raise ValueError(f"message of {nbytes} bytes exceeds ShmRing {self.name!r} slot size "
                       f"{self.slot_bytes}")
    i = self._wait_claim(_EMPTY, _WRITING, False, timeout, check, "free")
    try:
      pack_message(self._slot_view(i), meta, arrays)
    except BaseException:
      self._set_state(i, _EMPTY)
      raise
    self._set_state(i, _FULL, nbytes)

  @contextlib.contextmanager
  def read(self, *, timeout: float | None = None,
           check: Callable[[], None] | None = None) -> Iterator[tuple[dict, dict[str, np.ndarray]]]:
    """Yields the oldest ready message as zero-copy views; the slot is freed on exit."""
    i = self._wait_claim(_FULL, _READING, True, timeout, check, "ready")
    try:
      yield unpack_message(self._slot_view(i, int(self._slots[i, 2])))
    finally:
      self._set_state(i, _EMPTY, 0)

  def get(self, *, timeout: float | None = None,
          check: Callable[[], None] | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Like `read` but returns copies, so the slot is free when this returns."""
    with self.read(timeout=timeout, check=check) as (meta, arrays):
      return meta, {k: np.array(v) for k, v in arrays.items()}

  def pending(self) -> int:
    """Number of messages ready to be read."""
    with self._locked():
      return int(np.sum(self._slots[:, 0] == _FULL))

  def close(self, unlink: bool | None = None) -> None:
    """Unmaps the ring; unlinks its name if `unlink` (default: if this process created it)."""
    if unlink if unlink is not None else self._owner:
      unlink_segment(self.name)
    # Drop our own views before unmapping.
    self._glob = self._slots = None
    self._bell.close()
    close_segment(self._shm)


class ShmBlock:
  """One shared segment holding one message (e.g. a weight state dict), rewritten in place."""

  def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
    self._shm = shm
    self.name = shm.name
    self.size = shm.size
    self._owner = owner

  @classmethod
  def create(cls, name: str, size: int) -> "ShmBlock":
    return cls(open_segment(name, _align(size), create=True), owner=True)

  @classmethod
  def attach(cls, name: str) -> "ShmBlock":
    return cls(open_segment(name), owner=False)

  def write(self, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray],
            threads: int = 1, min_threaded_bytes: int = MIN_THREADED_BYTES) -> int:
    """`pack_message` into the block; returns the bytes used."""
    return pack_message(self._shm.buf, meta, arrays, threads, min_threaded_bytes)

  def read(self) -> tuple[dict, dict[str, np.ndarray]]:
    """Zero-copy views; valid until the block is rewritten or closed."""
    return unpack_message(self._shm.buf)

  def close(self, unlink: bool | None = None) -> None:
    if unlink if unlink is not None else self._owner:
      unlink_segment(self.name)
    close_segment(self._shm)


class ControlBlock:
  """The generation process's control block: state, pid, heartbeat and a startup error text.

  A small shared segment: four float64 fields at the start (``state``, ``pid``, ``heartbeat`` as
  `time.monotonic()`: CLOCK_MONOTONIC, one clock for every process of a host, which no wall-clock
  step moves, ``error_len``), the UTF-8 error text from byte ``TEXT_OFFSET`` on. The trainer
  creates it; the worker attaches, reports its pid, beats, and moves ``state`` through the
  ``STARTING -> ATTACHED -> READY | FAILED -> EXITED`` states below.
  """

  STARTING, ATTACHED, READY, FAILED, EXITED = 0.0, 1.0, 2.0, 3.0, 4.0
  SIZE = 1 << 16
  TEXT_OFFSET = 256
  _FIELDS = ("state", "pid", "heartbeat", "error_len")

  def __init__(self, shm: shared_memory.SharedMemory, owner: bool):
    self._shm = shm
    self.name = shm.name
    self._owner = owner
    self._fields = np.ndarray((len(self._FIELDS),), np.float64, buffer=shm.buf)

  @classmethod
  def create(cls, name: str) -> "ControlBlock":
    block = cls(open_segment(name, cls.SIZE, create=True), owner=True)
    block._fields[:] = 0.0
    return block

  @classmethod
  def attach(cls, name: str) -> "ControlBlock":
    return cls(open_segment(name), owner=False)

  def _get(self, field: str) -> float:
    return float(self._fields[self._FIELDS.index(field)])

  def _set(self, field: str, value: float) -> None:
    self._fields[self._FIELDS.index(field)] = value

  state = property(lambda self: self._get("state"), lambda self, v: self._set("state", v))
  pid = property(lambda self: int(self._get("pid")), lambda self, v: self._set("pid", v))
  heartbeat = property(lambda self: self._get("heartbeat"),
                       lambda self, v: self._set("heartbeat", v))

  def fail(self, text: str) -> None:
    """Stores ``text`` (truncated to fit) and sets the state to FAILED."""
    data = text.encode()[:self.SIZE - self.TEXT_OFFSET]
    self._shm.buf[self.TEXT_OFFSET:self.TEXT_OFFSET + len(data)] = data
    self._set("error_len", len(data))
    self.state = self.FAILED

  def error(self) -> str:
    """The text stored by `fail` ('' if none)."""
    n = int(self._get("error_len"))
    return bytes(self._shm.buf[self.TEXT_OFFSET:self.TEXT_OFFSET + n]).decode(errors="replace")

  def close(self, unlink: bool | None = None) -> None:
    self._fields = None  # drop the view before closing the mapping
    if unlink if unlink is not None else self._owner:
      unlink_segment(self.name)
    close_segment(self._shm)
