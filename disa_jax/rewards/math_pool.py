"""Time-bounded math grading: a pool of worker processes with a per-item wall-clock bound.

math-verify cannot bound its own time outside a main thread, and nothing in Python can interrupt a
C-level computation such as `9**(9**(9**9))`. So grading runs in separate worker processes; each
item gets `timeout_s` of wall-clock time from the moment it is handed to an idle worker, and a
worker that overruns is SIGKILLed, replaced, and its item scored 0. A worker that dies for any other
reason is replaced the same way. Workers announce themselves ready only after importing the grader
and grading a warm-up item, so the import time of a replacement never counts against an item's
bound.

Workers are plain `python -c` subprocesses (fork + exec, safe next to JAX's threads) that talk to
the pool over a private socket pair. Unlike multiprocessing's `spawn` and `forkserver`, this never
re-imports the caller's `__main__`, so the math reward works from notebooks and from scripts without
an `if __name__ == "__main__":` guard. A worker exits when the pool's process dies.

Grader failures are not wrong answers: an item whose grader raised, overran its bound, or whose
worker died is scored 0 AND marked in an `[n]` bool error array (`return_errors=True` returns
`Graded(reward, error)`, `disa_jax.rewards.graded`); a call with more than `ERROR_SHARE_WARN` (5%)
failed items warns (`GraderErrorWarning`) and logs.

Public API: `math_reward(response, ground_truth) -> float` and
`math_rewards(responses, ground_truths, *, timeout_s, workers, return_errors=False)
-> np.ndarray [n] float32 | Graded`, which use a shared per-process pool (created lazily, closed at
exit), and `MathGraderPool` for explicit control. The grading function is a hook: `grader=
"module:function"` (default `DEFAULT_GRADER`), imported in the workers; it takes
`(response, ground_truth)` and returns a truth value.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Sequence

import numpy as np

from disa_jax import preemption
from disa_jax.rewards.graded import ERROR_SHARE_WARN, Graded, warn_on_errors

__all__ = ["MathGraderPool", "math_reward", "math_rewards", "DEFAULT_TIMEOUT_S", "DEFAULT_GRADER",
           "ERROR_SHARE_WARN", "Graded"]

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_GRADER = "disa_jax.rewards.math_verify_grader:grade"
_READY = "__ready__"
# Run by `python -c` in a worker: argv = [fd of the socket, grader, the pool's sys.path as JSON].
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[3]); "
         "from disa_jax.rewards.math_pool import _worker_entry; "
         "_worker_entry(int(sys.argv[1]), sys.argv[2])")


def _resolve_grader(spec: str) -> Callable[[str, Any], Any]:
  """`'module:function'` -> the function."""
  module, _, name = spec.partition(":")
  if not module or not name:
    raise ValueError(f"grader must be 'module:function', got {spec!r}")
  return getattr(importlib.import_module(module), name)


def _worker_entry(fd: int, grader: str) -> None:
  """A worker process: connects to the pool over socket ``fd`` and grades until told to stop."""
  preemption.ignore_in_child()  # the stage saves on SIGTERM / SIGUSR1, then closes the pool
  preemption.stop_with_parent(os.getppid())  # (no stage runs here: it exits at once)
  _worker_main(mp_connection.Connection(fd), grader)


def _worker_main(conn, grader: str = DEFAULT_GRADER) -> None:
  """Worker loop: receives `(index, response, ground_truth)`, sends `(index, reward, error)`.

  `error` is None, or "ExceptionType: message" when the grader raised (the reward is then 0).
  """
  grade = _resolve_grader(grader)
  grade("\\boxed{1}", "1")  # warm-up: imports and first-parse cost paid here
  try:
    conn.send(_READY)
    while True:
      msg = conn.recv()
      if msg is None:
        return
      index, response, ground_truth = msg
      try:
        reward, error = (1.0 if grade(response, ground_truth) else 0.0), None
      except Exception as e:  # pylint: disable=broad-except
        reward, error = 0.0, f"{type(e).__name__}: {str(e)[:200]}"
      conn.send((index, reward, error))
  except (EOFError, OSError):  # the pool closed its end or its process is gone
    return


class _Worker:
  """One worker process (`python -c`) and its end of a socket pair."""

  def __init__(self, grader: str):
    ours, theirs = socket.socketpair()
    fd = theirs.fileno()
    try:
      with preemption.shielded_start():  # a SIGTERM to the job while it starts: dropped there
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(fd), grader, json.dumps(sys.path)],
            pass_fds=(fd,), stdin=subprocess.DEVNULL, close_fds=True)
    finally:
      theirs.close()
    self.conn = mp_connection.Connection(ours.detach())
    self.ready = False
    self.item: int | None = None
    self.deadline = 0.0

  def alive(self) -> bool:
    return self.proc.poll() is None

  def kill(self) -> None:
    if self.alive():
      self.proc.kill()
    try:
      self.proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
      pass
    self.conn.close()


class MathGraderPool:
  """A pool of math-grading worker processes with a per-item wall-clock bound.

  Args:
    workers: number of worker processes.
    grader: the grading function as 'module:function' (imported in each worker; it must be
      importable from this process's `sys.path`): `(response, ground_truth) -> truthy`. The hook
      for other graders and for fault injection in tests.
    startup_timeout_s: how long a new worker may take to import the grader before it is an error.
  """

  def __init__(self, workers: int = 2, *, grader: str = DEFAULT_GRADER,
               startup_timeout_s: float = 120.0):
    if workers < 1:
      raise ValueError(f"workers must be >= 1, got {workers}")
    module, _, name = grader.partition(":")
    if not module or not name:
      raise ValueError(f"grader must be 'module:function', got {grader!r}")
    self._n = workers
    self.grader = grader
    self._startup_timeout_s = startup_timeout_s
    self._workers: list[_Worker] = [_Worker(grader) for _ in range(workers)]
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
        f"row (grader {self.grader!r}: it must import and grade a warm-up item; see the workers' "
        "stderr)")

  def _replace(self, i: int) -> None:
    self._workers[i].kill()
    self._workers[i] = _Worker(self.grader)

  def grade(self, responses: Sequence[str], ground_truths: Sequence[Any], *,
            timeout_s: float = DEFAULT_TIMEOUT_S, return_errors: bool = False
            ) -> np.ndarray | Graded:
    """Grades `responses[i]` against `ground_truths[i]`.

    Args:
      responses: n model responses.
      ground_truths: n ground truths (str, number, or list of acceptable answers).
      timeout_s: wall-clock bound per item, from hand-off to an idle worker.
      return_errors: return `Graded(reward, error)` instead of the rewards alone.

    Returns:
      `[n]` float32 array of 1.0 / 0.0; with `return_errors`, `Graded` whose `[n]` bool `error`
      marks the items whose grader raised, timed out, or whose worker died (their reward is 0).
      Either way, more than `ERROR_SHARE_WARN` failed items warn (`GraderErrorWarning`).

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
    with self._lock:
      if self._closed:
        raise RuntimeError("MathGraderPool is closed")
      run = _Run(responses, ground_truths, timeout_s)
      while run.remaining:
        self._dispatch(run)
        self._collect(run)
    warn_on_errors(run.error, what="math grading", examples=run.reasons)
    return Graded(run.reward, run.error) if return_errors else run.reward

  def _dispatch(self, run: "_Run") -> None:
    """Hands pending items to idle ready workers."""
    now = time.monotonic()
    for w in self._workers:
      if w.ready and w.item is None and run.pending:
        idx = run.pending.popleft()
        try:
          w.conn.send((idx, run.responses[idx], run.ground_truths[idx]))
          w.item, w.deadline = idx, now + run.timeout_s
        except (BrokenPipeError, OSError):
          run.pending.appendleft(idx)
          w.ready = False
          w.deadline = 0.0

  def _collect(self, run: "_Run") -> None:
    """Waits for a message or the nearest deadline; records results, replaces dead workers."""
    now = time.monotonic()
    for i, w in enumerate(self._workers):
      if not w.ready:
        run.starting_since.setdefault(i, now)
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
          run.starting_since.pop(i, None)
        elif msg is None:  # the worker died: its item (if any) failed; start a new one
          if w.item is not None:
            run.fail(w.item, "the grading worker died")
          else:
            self._start_failed(i)
          self._replace(i)
          run.starting_since[i] = now
        else:
          idx, reward, error = msg
          if idx == w.item:
            run.done(idx, reward, error)
            w.item = None
      elif w.item is not None and now >= w.deadline:
        run.fail(w.item, f"timed out after {run.timeout_s} s")
        self.num_killed += 1
        self._replace(i)
        run.starting_since[i] = now
      elif not w.ready and not w.alive():  # died while starting: retry a few times
        self._start_failed(i)
        self._replace(i)
    for i, t0 in list(run.starting_since.items()):
      if now - t0 > self._startup_timeout_s:
        raise RuntimeError(f"math grading worker {i} did not start within "
                           f"{self._startup_timeout_s} s (grader {self.grader!r})")

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
        try:
          w.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
          pass
        w.kill()

  def __enter__(self) -> "MathGraderPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class _Run:
  """The state of one `grade` call: results so far and the items still to hand out."""

  def __init__(self, responses, ground_truths, timeout_s: float):
    self.responses, self.ground_truths, self.timeout_s = responses, ground_truths, timeout_s
    self.reward = np.zeros(len(responses), np.float32)  # [n]
    self.error = np.zeros(len(responses), bool)  # [n]
    self.reasons: list[str] = []
    self.pending = collections.deque(range(len(responses)))
    self.remaining = len(responses)
    self.starting_since: dict[int, float] = {}

  def done(self, idx: int, reward: float, error: str | None) -> None:
    if error is None:
      self.reward[idx] = reward
      self.remaining -= 1
    else:
      self.fail(idx, error)

  def fail(self, idx: int, reason: str) -> None:
    self.reward[idx], self.error[idx] = 0.0, True
    self.reasons.append(f"item {idx}: {reason}")
    self.remaining -= 1


_POOLS: dict[tuple[int, str], MathGraderPool] = {}
_POOLS_LOCK = threading.Lock()


def _shared_pool(workers: int, grader: str = DEFAULT_GRADER) -> MathGraderPool:
  with _POOLS_LOCK:
    pool = _POOLS.get((workers, grader))
    if pool is None or pool._closed:  # pylint: disable=protected-access
      pool = MathGraderPool(workers, grader=grader)
      _POOLS[(workers, grader)] = pool
    return pool


@atexit.register
def _close_shared_pools() -> None:
  for pool in list(_POOLS.values()):
    pool.close()


def math_rewards(responses: Sequence[str], ground_truths: Sequence[Any], *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 2,
                 return_errors: bool = False, grader: str = DEFAULT_GRADER
                 ) -> np.ndarray | Graded:
  """Batched math reward through the shared worker pool.

  Works from scripts without a `__main__` guard and from notebooks (see the module docstring).

  Args:
    responses: n model responses.
    ground_truths: n ground truths (str, number, or list of acceptable answers).
    timeout_s: wall-clock bound per item.
    workers: number of worker processes of the shared pool to use.
    return_errors: return `Graded(reward, error)` instead of the rewards alone.
    grader: the grading function, 'module:function' (one shared pool per workers and grader).

  Returns:
    `[n]` float32 rewards in {0, 1}; with `return_errors`, `Graded` (`error`: `[n]` bool, True
    where the grader raised or timed out; those rewards are 0).
  """
  return _shared_pool(workers, grader).grade(responses, ground_truths, timeout_s=timeout_s,
                                             return_errors=return_errors)


def math_reward(response: str, ground_truth: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
  """1.0 if the final answer of `response` is correct for `ground_truth`, else 0.0 (time-bounded).

  Uses the shared 2-worker pool of `math_rewards` (no `__main__` guard needed). A grader failure
  scores 0.0 and warns; use `math_rewards(..., return_errors=True)` to tell it apart.

  Args:
    response: a model response.
    ground_truth: the answer string (or number, or list of acceptable answers).
    timeout_s: wall-clock bound.

  Returns:
    1.0 or 0.0.
  """
  return float(math_rewards([response], [ground_truth], timeout_s=timeout_s)[0])
