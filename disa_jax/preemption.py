"""Preemption: SIGTERM or SIGUSR1 asks a running stage to save at its next step boundary and exit 0.

A cluster stops a job with SIGTERM (SLURM's preemption and ``scancel``, Kubernetes, TPU
maintenance events) and, asked with ``sbatch --signal=USR1@<seconds>``, warns it with SIGUSR1 ahead
of its time limit. Inside `watch()` both signals only set a flag; the stage loops (Stage 1 between
prompt batches, Stage 3 between RL steps, the LoRA-SFT baseline between updates) call `agreed()` at
each step boundary and, when it is true, save what they have (Stage 1: the batch just written is
durable; Stage 3 / SFT: a checkpoint at the step just finished), return a summary with
``preempted`` set and the command exits 0. Rerunning the same command resumes exactly (the same
results as an uninterrupted run: tests/workflows/test_preemption.py).

A stage without a result to return early (Stage 2, evaluation) raises `Stopped` at its resume
point instead, saying what it kept; the command prints that one line and exits 0
(`disa_jax.launcher`). Stage 2 stops once its embedding pass is cached (a rerun fits from the
cache); evaluation between chunks of prompts (each chunk's graded rows are appended to
``<name>_responses.jsonl``; a rerun continues from the first prompt without a row).

Before a run begins, while a command parses its flags and checks its config, there is nothing to
save: `exit_until_started` makes both signals exit 0 at once with one line (no traceback), until
`started()` (the launcher calls it as the run begins: the stage's own `watch()` then applies).

Bound: the signal is acted on at the end of the step in progress, so a stage exits within one step
(Stage 3: one RL step, ``time/step_s`` in metrics.jsonl; Stage 1: one prompt batch; SFT: one update)
plus one checkpoint write. ``--signal``'s lead time must exceed that (launch/slurm/*.sbatch ask for
15 minutes).

Child processes (the generation process, the math-grading pool) ignore both signals
(`ignore_in_child`): the stage that owns them closes them after its save, and they exit on their own
when their parent dies. A child started inside `shielded_start` is covered from its first
instruction: it inherits both signals blocked, so one that reaches it while its interpreter still
starts (SLURM signals the whole job step, children included) waits, pending, until
`ignore_in_child` discards it; without that, a SIGTERM during the generation process's start-up
killed it and failed the stage instead of stopping it cleanly. In a multi-process run every
process must see the same decision at the same step, so `agreed()` is a collective there
(`disa_jax.parallel.distributed.any_process`: an all-gather of one flag per process and step).
This module itself needs only the standard library, so that the grading pool's light worker
processes can import it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from multiprocessing import resource_tracker
from typing import Callable, Iterator

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_received: list[int] = []  # the signals received while a `watch()` is active, in order
_depth = [0]  # nesting of active `watch()` contexts (a workflow inside a workflow)
_depth_lock = threading.Lock()  # (nested contexts may be entered from several threads)
# Set once a pool worker's parent is gone (`stop_with_parent`): no stage may start or go on.
_orphaned = threading.Event()


class Stopped(Exception):
  """A stage stopped at a resume point on a preemption signal; the message says what it kept and
  that rerunning the command resumes. The command prints it and exits 0."""


def _exit_at_once(signum: int, frame) -> None:  # pylint: disable=unused-argument
  print(f"preemption: received {signal.Signals(signum).name} before the run began; nothing to "
        "save, exiting 0", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(0)  # (nothing is written yet; no exception to be caught half-way through an import)


def exit_until_started() -> None:
  """Until `started`: SIGTERM / SIGUSR1 exit 0 at once with one line (a command parsing its flags
  and checking its config has nothing to save). A no-op outside the main thread."""
  if threading.current_thread() is threading.main_thread():
    for s in SIGNALS:
      signal.signal(s, _exit_at_once)


def started() -> None:
  """The run begins: the signals' default action again (a stage's `watch()` takes them over)."""
  if threading.current_thread() is threading.main_thread():
    for s in SIGNALS:
      if signal.getsignal(s) is _exit_at_once:
        signal.signal(s, signal.SIG_DFL)


def _handle(signum: int, frame) -> None:  # pylint: disable=unused-argument
  _received.append(signum)
  print(f"preemption: received {signal.Signals(signum).name}; saving at the end of the current "
        "step, then exiting 0", file=sys.stderr, flush=True)


@contextlib.contextmanager
def watch() -> Iterator[None]:
  """Within the context SIGTERM / SIGUSR1 set the preemption flag instead of ending the process.

  The outermost context must be entered from the main thread (Python delivers signals there).
  Nested contexts share the outer one's handlers, from any thread while it is active (the seeds of
  `disa_jax.rl.seed_batch`, each a stage in a thread of its own); the outermost restores the
  previous handlers and clears the flag on exit.
  """
  with _depth_lock:
    nested = _depth[0] > 0
    _depth[0] += nested
  if nested:
    try:
      yield
    finally:
      with _depth_lock:
        _depth[0] -= 1
    return
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("preemption.watch() must be entered from the main thread (signal handlers "
                       "can only be installed there)")
  _exit_if_orphaned()  # a pool worker whose parent is gone takes no further stage
  old = {s: signal.signal(s, _handle) for s in SIGNALS}
  _depth[0] = 1
  try:
    yield
  finally:
    _depth[0] = 0
    for s, h in old.items():
      signal.signal(s, h)
    _received.clear()
    _exit_if_orphaned()  # (its stage saved; nobody is left to collect a result)


def _exit_if_orphaned() -> None:
  if _orphaned.is_set():
    print("preemption: the parent process is gone; this worker exits", file=sys.stderr,
          flush=True)
    os._exit(0)


def request(signum: int = signal.SIGTERM) -> None:
  """Sets the preemption flag as the signal ``signum`` would (from any thread)."""
  _handle(signum, None)


def _stop_when_orphaned(parent_pid: int, poll_s: float) -> None:
  while os.getppid() == parent_pid:
    time.sleep(poll_s)
  print(f"preemption: parent process {parent_pid} is gone", file=sys.stderr, flush=True)
  _orphaned.set()  # before the request: a stage ending now must not let the worker take another
  request(signal.SIGTERM)
  while _depth[0] > 0:  # the stage in progress saves at its step boundary and leaves `watch()`
    time.sleep(poll_s)
  os._exit(0)  # nobody is left to hand this process another stage


def stop_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
  """For a worker process whose parent hands it whole stages (`SumJob.stage3_all`'s pool) or
  requests (the math-grading pool's workers, which exit at once: no stage in progress): once
  the parent is gone (killed, say, with nobody left to collect the result), the stage in progress
  stops as on SIGTERM, saving at its next step boundary, and the process then exits instead of
  training on, or idling, as an orphan. Starts a daemon thread that polls the parent every
  ``poll_s`` seconds (a pool initializer)."""
  threading.Thread(target=_stop_when_orphaned, args=(parent_pid, poll_s), daemon=True,
                   name="stop-with-parent").start()


def requested() -> str | None:
  """The name of the first preemption signal this process received, or None."""
  return signal.Signals(_received[0]).name if _received else None


def agreed(any_process: Callable[[bool], bool] = lambda flag: flag) -> bool:
  """Whether a preemption signal arrived, in this process or (through ``any_process``, e.g.
  `disa_jax.parallel.distributed.any_process`, a collective every process must call at the same
  step boundary) in any process of the run."""
  return any_process(bool(_received))


@contextlib.contextmanager
def shielded_start() -> Iterator[None]:
  """Processes started inside the context start with SIGTERM / SIGUSR1 blocked.

  The calling thread blocks both signals for the duration (a child inherits its mask through fork
  and exec); a child that calls `ignore_in_child` first thing then drops any that arrived while it
  started. This process loses nothing: a signal sent to it meanwhile is handled by another thread
  or, when none is left unblocked, stays pending until the context restores the mask.
  """
  # multiprocessing's spawn starts its resource tracker on first use and then unblocks SIGTERM
  # (`ResourceTracker.ensure_running` blocks and unblocks SIGINT / SIGTERM around that start): it
  # is started first, so that the mask set here holds while the child starts.
  resource_tracker.ensure_running()
  old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_in_child() -> None:
  """For a child process the stage owns: ignore SIGTERM / SIGUSR1 (its parent closes it), and
  discard any that arrived, blocked, while it started (`shielded_start`)."""
  for s in SIGNALS:
    signal.signal(s, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
