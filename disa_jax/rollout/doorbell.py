"""A doorbell between processes: a 32-bit counter in shared memory that waiters sleep on.

`shm.ShmRing`'s waits were polls (sleeps growing to 1 ms, 5 ms after ~2 s idle): a message that
arrived just after a poll waited up to a millisecond for the reader, on each side of a generation
call, and an idle generation process woke hundreds of times a second to look. With a doorbell, a
writer bumps the counter after changing the ring and wakes every sleeper (Linux ``futex(2)``,
``FUTEX_WAKE`` on a shared, i.e. not process-private, word); a reader notes the counter before
looking, and when there was nothing to take sleeps until the counter moves (``FUTEX_WAIT``
returns at once when it already has, so no ring is missed) or its timeout passes.

Where the futex call is not available (another OS, a machine whose syscall number is not in
`_SYS_FUTEX`), `Doorbell.wait` sleeps like the polls did, so the ring works as before.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
import time

import numpy as np

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # without FUTEX_PRIVATE_FLAG: the word is shared by processes
_WAKE_ALL = 2 ** 31 - 1


class _Timespec(ctypes.Structure):
  _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_syscall():
  """libc's ``syscall`` and the futex number of this machine, or None where there is none."""
  number = _SYS_FUTEX.get(platform.machine())
  if not sys.platform.startswith("linux") or number is None:
    return None
  libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
  fn = libc.syscall  # a CDLL call: the GIL is released while the caller sleeps
  fn.restype = ctypes.c_long
  return fn, number


_FUTEX = _futex_syscall()


def sleep_backoff(i: int) -> None:
  """Polling back-off: yield, then sleep up to 1 ms; after ~2 s idle, up to 5 ms (low idle CPU)."""
  time.sleep(0.0 if i < 20 else min(1e-3 if i < 2000 else 5e-3, 2e-5 * (i - 19)))


class Doorbell:
  """A counter word (``word``: a one-element uint32 view into shared memory) to ring and wait on.

  Every process maps the word through its own view; `ring` after a change the others may wait
  for, `value` before looking for it, `wait` when it was not there.
  """

  def __init__(self, word: np.ndarray):
    if word.dtype != np.uint32 or word.shape != (1,) or word.ctypes.data % 4:
      raise ValueError(f"doorbell word must be one aligned uint32, got {word.dtype} {word.shape}")
    self._word, self._futex = word, _FUTEX
    self._addr = ctypes.c_void_p(word.ctypes.data)

  @property
  def sleeps(self) -> bool:
    """True where `wait` sleeps on the word (futex), False where it polls."""
    return self._futex is not None

  def value(self) -> int:
    return int(self._word[0])

  def ring(self) -> None:
    """Moves the counter (wrapping at 2**32) and wakes every waiter."""
    self._word[0] = (int(self._word[0]) + 1) & 0xFFFFFFFF
    if self._futex is not None:
      fn, number = self._futex
      fn(ctypes.c_long(number), self._addr, ctypes.c_long(_FUTEX_WAKE), ctypes.c_long(_WAKE_ALL),
         None, None, ctypes.c_long(0))

  def wait(self, seen: int, timeout: float, polls: int = 0) -> None:
    """Returns once the counter is no longer ``seen``, or after ``timeout`` seconds (maybe
    earlier: a signal, or a spurious wake-up; the caller looks again). Without futex: one poll
    back-off step (``polls``: the caller's count of them)."""
    if self._futex is None:
      sleep_backoff(polls)
      return
    timeout = max(timeout, 0.0)
    ts = _Timespec(int(timeout), int((timeout % 1.0) * 1e9))
    fn, number = self._futex
    fn(ctypes.c_long(number), self._addr, ctypes.c_long(_FUTEX_WAIT), ctypes.c_long(seen),
       ctypes.byref(ts), None, ctypes.c_long(0))

  def close(self) -> None:
    """Drops the view on the shared word (so that its segment can be unmapped)."""
    self._word = None
