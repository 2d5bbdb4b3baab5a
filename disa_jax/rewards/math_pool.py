"""Time-bounded math grading: a pool of worker processes with a per-item wall-clock bound.

math-verify cannot bound its own time outside a main thread, and nothing in Python can interrupt a
C-level computation such as `9**(9**(9**9))`. So grading runs in separate worker processes (started
with `spawn`, safe next to JAX's threads); each item gets `timeout_s` of wall-clock time from the
moment it is handed to an idle worker, and a worker that overruns is SIGKILLed, replaced, and its
item graded 0. A worker that dies for any other reason is replaced the same way. Workers announce
themselves ready only after importing math-verify and grading a warm-up item, so the import time of
a replacement never counts against an item's bound.

Public API: `math_reward(response, ground_truth) -> float` and
`math_rewards(responses, ground_truths, *, timeout_s, workers) -> np.ndarray [n] float32`, which
use a shared per-process pool (created lazily, closed at exit), and `MathGraderPool` for explicit
control.
"""

from __future__ import annotations

import atexit
import collections
import multiprocessing as mp
from multiprocessing import connection as mp_connection
import threading
import time
from typing import Any, Sequence

import numpy as np

__all__ = ["MathGraderPool", "math_reward", "math_rewards", "DEFAULT_TIMEOUT_S"]

DEFAULT_TIMEOUT_S = 5.0
_READY = "__ready__"


def _worker_main(conn) -> None:
  """Worker loop: receives `(index, response, ground_truth)`, sends `(index, reward)`."""
  from disa_jax.rewards import math_verify_grader  # pylint: disable=g-import-not-at-top
  math_verify_grader.grade("\\boxed{1}", "1")  # warm-up: imports and first-parse cost paid here
  conn.send(_READY)
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    index, response, ground_truth = msg
    try:
      reward = 1.0 if math_verify_grader.grade(response, ground_truth) else 0.0
    except Exception:  # pylint: disable=broad-except
      # A parser crash on hostile input is a wrong answer, not a grader failure.
      reward = 0.0
    conn.send((index, reward))


class _Worker:
  """One worker process and its pipe."""

  def __init__(self, ctx):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
    self.proc.start()
    child.close()
    self.ready = False
    self.item: int | None = None
    self.deadline = 0.0

  def kill(self) -> None:
    if self.proc.is_alive():
      self.proc.kill()
    self.proc.join(timeout=5.0)
    self.conn.close()


class MathGraderPool:
  """A pool of math-verify worker processes with a per-item wall-clock bound.

  Args:
    workers: number of worker processes.
    start_method: multiprocessing start method ('spawn' or 'forkserver'; not 'fork', which is
      unsafe next to JAX's threads).
    startup_timeout_s: how long a new worker may take to import math-verify before it is an error.
  """

  def __init__(self, workers: int = 2, *, start_method: str = "spawn",
               startup_timeout_s: float = 120.0):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    if start_method not in ("spawn", "forkserver"):
      raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {start_method!r}")
    self._ctx = mp.get_context(start_method)
    self._n = workers
    self._startup_timeout_s = startup_timeout_s
    self._workers: list[_Worker] = [_Worker(self._ctx) for _ in range(workers)]
    self._lock = threading.Lock()
    self._closed = False
    self.num_killed = 0  # workers killed for overrunning their bound (for tests and logs)
    self._failed_starts = [0] * workers  # consecutive deaths before READY, per slot

  @property
  def workers(self) -> int:
    return self._n

  def _start_failed(self, i: int) -> None:
    self._failed_starts[i] += 1
    if self._failed_starts[i] >= 3:
      raise RuntimeError(
        f"math grading worker {i} died before it was ready {self._failed_starts[i]} times in a "
        "row (workers are started with 'spawn': the main module must be importable, e.g. a file "
        "with an `if __name__ == '__main__':` guard; see the workers' stderr)")

  def _replace(self, i: int) -> None:
    self._workers[i].kill()
    self._workers[i] = _Worker(self._ctx)

  def grade(self, responses: Sequence[str], ground_truths: Sequence[Any], *,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> np.ndarray:
    """Grades `responses[i]` against `ground_truths[i]`.

    Args:
      responses: n model responses.
      ground_truths: n ground truths (str, number, or list of acceptable answers).
      timeout_s: wall-clock bound per item, from hand-off to an idle worker.

    Returns:
      `[n]` float32 array of 1.0 / 0.0.

    Raises:
      ValueError: on length mismatch or a non-positive timeout.
      RuntimeError: when a worker cannot start within `startup_timeout_s`.
    """
    if len(responses) != len(ground_truths):
      raise ValueError(f"responses ({len(responses)}) and ground_truths ({len(ground_truths)}) "
                       "differ in length")
    if not timeout_s > 0:
      raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    for i, r in enumerate(responses):
      if not isinstance(r, str):
        raise ValueError(f"responses[{i}] must be str, got {type(r).__name__}")
    out = np.zeros(len(responses), np.float32)
    with self._lock:
      if self._closed:
        raise RuntimeError("MathGraderPool is closed")
      pending = collections.deque(range(len(responses)))
      remaining = len(responses)
      starting_since = {i: time.monotonic() for i, w in enumerate(self._workers) if not w.ready}
      while remaining:
        now = time.monotonic()
        # Hand items to idle ready workers.
        for w in self._workers:
          if w.ready and w.item is None and pending:
            idx = pending.popleft()
            try:
              w.conn.send((idx, responses[idx], ground_truths[idx]))
              w.item, w.deadline = idx, now + timeout_s
            except (BrokenPipeError, OSError):
              pending.appendleft(idx)
              w.ready = False
              w.deadline = 0.0
        # Wait for a message or the nearest deadline.
        waits = [w.deadline - now for w in self._workers if w.item is not None]
        wait_s = max(0.0, min(waits)) if waits else 0.5
        ready = mp_connection.wait([w.conn for w in self._workers], timeout=wait_s)
        now = time.monotonic()
        for i, w in enumerate(self._workers):
          if w.conn in ready:
            try:
              msg = w.conn.recv()
            except (EOFError, OSError):
              msg = None
            if msg == _READY:
              w.ready = True
              self._failed_starts[i] = 0
              starting_since.pop(i, None)
              continue
            if msg is None:  # the worker died: its item (if any) is wrong, start a new one
              if w.item is not None:
                out[w.item] = 0.0
                remaining -= 1
                starting_since[i] = now
              else:
                self._start_failed(i)
                starting_since.setdefault(i, now)
              self._replace(i)
              continue
            idx, reward = msg
            if idx == w.item:
              out[idx] = reward
              remaining -= 1
              w.item = None
          elif w.item is not None and now >= w.deadline:
            out[w.item] = 0.0  # overran its bound: graded 0, worker replaced
            remaining -= 1
            self.num_killed += 1
            self._replace(i)
            starting_since[i] = now
          elif not w.ready and not w.proc.is_alive():
            # Died while starting: retry a few times, keeping the first start time.
            self._start_failed(i)
            self._replace(i)
            starting_since.setdefault(i, now)
        for i, t0 in list(starting_since.items()):
          if now - t0 > self._startup_timeout_s:
            raise RuntimeError(f"math grading worker {i} did not start within "
                               f"{self._startup_timeout_s} s")
    return out

  def close(self) -> None:
    """Stops all workers."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      for w in self._workers:
        try:
          w.conn.send(None)
        except (BrokenPipeError, OSError):
          pass
      for w in self._workers:
        w.proc.join(timeout=2.0)
        w.kill()

  def __enter__(self) -> "MathGraderPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


_POOLS: dict[int, MathGraderPool] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pool(workers: int) -> MathGraderPool:
  with _POOLS_LOCK:
    pool = _POOLS.get(workers)
    if pool is None or pool._closed:  # pylint: disable=protected-access
      pool = MathGraderPool(workers)
      _POOLS[workers] = pool
    return pool


@atexit.register
def _close_shared_pools() -> None:
  for pool in list(_POOLS.values()):
    pool.close()


def math_rewards(responses: Sequence[str], ground_truths: Sequence[Any], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 2) -> np.ndarray:
  """Batched math reward through the shared worker pool.

  Args:
    responses: n model responses.
    ground_truths: n ground truths (str, number, or list of acceptable answers).
    timeout_s: wall-clock bound per item.
    workers: number of worker processes of the shared pool to use.

  Returns:
    `[n]` float32 rewards in {0, 1}.
  """
  return _shared_pool(workers).grade(responses, ground_truths, timeout_s=timeout_s)


def math_reward(response: str, ground_truth: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
  """1.0 if the final answer of `response` is correct for `ground_truth`, else 0.0 (time-bounded).

  Uses the shared 2-worker pool of `math_rewards`. Processes are started with `spawn`, so a script
  that calls this at import time needs an `if __name__ == '__main__':` guard.

  Args:
    response: a model response.
    ground_truth: the answer string (or number, or list of acceptable answers).
    timeout_s: wall-clock bound.

  Returns:
    1.0 or 0.0.
  """
  return float(math_rewards([response], [ground_truth], timeout_s=timeout_s)[0])
