"""Removing what vLLM's processes leave in /dev/shm when they end without cleaning up.

vLLM creates POSIX shared memory through Python's `multiprocessing.shared_memory` (``psm_*`` names:
the message queues between its API server, engine core and workers, its multimodal caches) and
named semaphores through `multiprocessing` locks (``sem.mp-*``). Python's resource tracker removes
them when the processes that registered them are gone, but only if the tracker itself survives:

* a spawned generation process shares its parent's tracker (the fd is inherited), so a kill -9 of
  the worker strands its semaphores until the trainer exits. `use_private_resource_tracker` gives
  the worker its own tracker: a separate process that sees the worker's end (EOF on its pipe) and
  unlinks what the worker's process tree registered and did not release;
* ``vllm serve`` runs in its own session with its tracker as a child: a kill of the whole group
  kills the tracker too. `ProcessTreeShm` records, while the tree is alive, every /dev/shm name its
  processes map (``/proc/<pid>/maps``, matched by inode) and unlinks those names once the tree has
  ended.
"""
from __future__ import annotations

import os
from multiprocessing import resource_tracker
from typing import Iterable

SHM_DIR = "/dev/shm"


def use_private_resource_tracker() -> None:
  """Makes this process (and the children it starts later) use a resource tracker of its own.

  Call first thing in a spawned process. The inherited tracker fd (the parent's tracker) is closed;
  the next registration starts a new tracker, a child process that outlives a kill -9 of this one.
  """
  tracker = resource_tracker._resource_tracker  # pylint: disable=protected-access
  with tracker._lock:  # pylint: disable=protected-access
    if tracker._fd is not None:  # pylint: disable=protected-access
      os.close(tracker._fd)  # pylint: disable=protected-access
    tracker._fd = None  # pylint: disable=protected-access
    tracker._pid = None  # pylint: disable=protected-access
  tracker.ensure_running()


def _children(pid: int) -> list[int]:
  out = []
  try:
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/children") as f:
        out.extend(int(c) for c in f.read().split())
  except (FileNotFoundError, ProcessLookupError, PermissionError):
    pass
  return out


def process_tree(pid: int) -> list[int]:
  """``pid`` and its live descendants (from /proc)."""
  tree, todo = [], [pid]
  while todo:
    p = todo.pop()
    if os.path.isdir(f"/proc/{p}"):
      tree.append(p)
      todo.extend(_children(p))
  return tree


def mapped_shm_names(pids: Iterable[int]) -> set[str]:
  """The /dev/shm entries (shared memory segments, named semaphores) that ``pids`` have mapped.

  Matched by inode: glibc creates a named semaphore under a temporary name and links it to
  ``sem.<name>``, so a process's maps show the temporary (deleted) name, not the live one.
  """
  inodes = set()
  for pid in pids:
    try:
      with open(f"/proc/{pid}/maps") as f:
        for line in f:
          parts = line.split(None, 5)
          if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
            inodes.add(int(parts[4]))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
      continue
  names = set()
  if inodes and os.path.isdir(SHM_DIR):
    for entry in os.scandir(SHM_DIR):
      try:
        if entry.inode() in inodes and not entry.is_dir(follow_symlinks=False):
          names.add(entry.name)
      except FileNotFoundError:
        continue
  return names


def unlink_shm_names(names: Iterable[str]) -> list[str]:
  """Removes these /dev/shm entries where they still exist; returns the removed names."""
  removed = []
  for name in sorted(set(names)):
    if "/" in name or name in ("", ".", ".."):
      raise ValueError(f"not a /dev/shm entry name: {name!r}")
    try:
      os.unlink(os.path.join(SHM_DIR, name))
      removed.append(name)
    except FileNotFoundError:
      pass
  return removed


class ProcessTreeShm:
  """Records the /dev/shm names a process tree maps, to unlink them once it has ended.

  Call `record` while the tree is alive (e.g. after start-up, after work, and just before killing
  it); `release` after its processes have exited unlinks every recorded name still present.
  """

  def __init__(self, pid: int):
    self.pid = pid
    self.names: set[str] = set()

  def record(self) -> set[str]:
    self.names |= mapped_shm_names(process_tree(self.pid))
    return self.names

  def release(self) -> list[str]:
    return unlink_shm_names(self.names)
