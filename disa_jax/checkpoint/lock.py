"""An exclusive, process-lifetime lock on an output (one writer per Stage 1 dataset, run, ...).

`OutputLock(path)` takes ``fcntl.flock(LOCK_EX | LOCK_NB)`` on the lock file ``path`` and writes
its pid there. The kernel drops a flock when the last descriptor of the open file closes, so the
lock ends with the holder however it ends (return, exception, ``kill -9``): a stale lock file
never blocks a rerun. A second holder, in this process or another, gets `OutputLockedError`
naming the lock file and the holder's pid. Not for NFS: flock there is advisory per client. An
output named by a URL (``gs://``) is locked through a local file named after it
(`disa_jax.paths.lock_file`: object stores have no locks), against the writers of this machine.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from disa_jax import paths


class OutputLockedError(RuntimeError):
  """Another writer holds the output; ``path`` is the lock file, ``holder_pid`` its pid (or None),
  ``holder_note`` what the holder said of itself (e.g. the main job's preset; '' if nothing)."""

  def __init__(self, path: Path, holder_pid: int | None, what: str, holder_note: str = ""):
    self.path, self.holder_pid, self._what, self.holder_note = path, holder_pid, what, holder_note
    holder = f"pid {holder_pid}" + (f", {holder_note}" if holder_note else "")
    super().__init__(f"{what} is being written by another process ({holder}; lock file {path}). "
                     f"Wait for it to finish or stop it; two writers would mix their outputs.")

  def __reduce__(self):  # (pickled back from a worker process with its arguments)
    return type(self), (self.path, self.holder_pid, self._what, self.holder_note)


class OutputLock:
  """Holds an exclusive flock on ``path`` until `release` (or the process ends).

  Args:
    path: the lock file (created; its parent must exist), or a URL (`paths.lock_file`).
    what: the output it guards, for the error message (default: the lock file's parent).
    note: one line about this holder, written after its pid, that a refused writer's error names
      (the main job's preset).
  """

  def __init__(self, path: str | os.PathLike, what: str | None = None, note: str = ""):
    self.path = paths.lock_file(path)
    self._fd: int | None = None
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise
      pid, held_note = _read_holder(self.path)
      raise OutputLockedError(self.path, pid, what or str(self.path.parent), held_note) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n{' '.join(note.split())}\n".encode())
    self._fd = fd

  @property
  def held(self) -> bool:
    return self._fd is not None

  def release(self) -> None:
    """Drops the lock (idempotent). The lock file stays: removing it would race a new holder."""
    if self._fd is not None:
      fd, self._fd = self._fd, None
      os.close(fd)  # closing the only descriptor releases the flock

  def __enter__(self) -> "OutputLock":
    return self

  def __exit__(self, *exc) -> None:
    self.release()

  def __del__(self):
    self.release()


@contextlib.contextmanager
def owned_output(path: str | os.PathLike, what: str, claim: Callable[[], Any], *,
                 owner: bool = True) -> Iterator[None]:
  """A command's output, owned for the duration: on its ``owner`` (the process that writes it; the
  main process of a multi-process run) an `OutputLock` on ``path`` and then ``claim()`` (the
  output's identity check: `disa_jax.checkpoint.identity.claim_output`), released on exit; on the
  other processes nothing.

  Raises:
    OutputLockedError: another process holds the output.
  """
  if not owner:
    yield
    return
  with OutputLock(path, what):
    claim()
    yield


def _read_holder(path: Path) -> tuple[int | None, str]:
  """The holder's pid (None before it wrote it) and note."""
  try:
    lines = path.read_text().splitlines()
    return int(lines[0]), (lines[1] if len(lines) > 1 else "")
  except (OSError, ValueError, IndexError):  # the holder has not written its pid yet
    return None, ""
