"""A fork server for tests that start many short worker processes (the fault matrix).

Each fresh worker pays ~2-4 s of imports (jax, flax, orbax, transformers) before its stage starts;
the fault matrix starts 22 per stage. The server (`serve`, in ``kill_worker.py serve``) imports
once, then forks one child per request. The child starts where a fresh worker prints START: all
modules imported, no JAX backend initialised and no thread running (`serve` checks both before
every fork, so the child is what a fresh process after its imports would be). It runs the
request with its stdout and stderr appended to the request's files, then exits with ``os._exit``.

Protocol (one JSON object per line): the client writes ``{"stage", "config", "point", "stdout",
"stderr"}``;
the server answers ``{"pid": P}`` once the child is forked and ``{"exit": P, "code": C}`` when it
ends (``C`` as `subprocess.Popen.returncode`: the exit status, or minus the signal that killed it).

`ForkServer` (client side) gives each child as a `ForkedProcess` with the `subprocess.Popen`
methods the tests use (``pid``, ``poll``, ``wait``, ``communicate``, ``returncode``).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable


def _check_fork_safe() -> None:
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if xla_bridge._backends:  # pylint: disable=protected-access
    raise RuntimeError(f"fork server: a JAX backend is initialised ({list(xla_bridge._backends)})")  # pylint: disable=protected-access
  if threading.active_count() != 1:
    raise RuntimeError(f"fork server: {threading.active_count()} threads run; forking is unsafe")


def _child(request: dict[str, Any], handler: Callable[[dict[str, Any]], None]) -> None:
  """In the forked child: stdout and stderr on the request's files, the handler, then ``os._exit``
  (never returns)."""
  code = 0
  try:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, name in ((1, "stdout"), (2, "stderr")):
      fd = os.open(request[name], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      os.dup2(fd, target)
      os.close(fd)
    handler(request)
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if not isinstance(e.code, int) and e.code is not None:
      print(e.code, file=sys.stderr)
  except BaseException:  # pylint: disable=broad-except
    traceback.print_exc()
    code = 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


def _reap(out) -> None:
  while True:
    try:
      pid, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    out.write(json.dumps({"exit": pid, "code": code}) + "\n")
    out.flush()


def serve(handler: Callable[[dict[str, Any]], None]) -> None:
  """Forks a child running ``handler(request)`` per request line on stdin, until stdin closes
  (single-threaded: requests and child exits are polled)."""
  out = sys.stdout
  print(json.dumps({"ready": os.getpid()}), flush=True)
  buf, fd, open_ = b"", sys.stdin.fileno(), True
  while open_:
    ready, _, _ = select.select([fd], [], [], 0.05)
    if ready:
      data = os.read(fd, 1 << 16)
      open_ = bool(data)
      buf += data
    while b"\n" in buf:
      line, buf = buf.split(b"\n", 1)
      request = json.loads(line)
      _check_fork_safe()
      pid = os.fork()
      if pid == 0:
        _child(request, handler)
      out.write(json.dumps({"pid": pid}) + "\n")
      out.flush()
    _reap(out)
  while True:  # stdin closed: wait for the children still running
    _reap(out)
    try:
      os.waitpid(-1, 0)
    except ChildProcessError:
      return


class ForkServer:
  """Client of `serve`: ``ForkServer(cmd, env, cwd)`` starts the server, `start` forks a child."""

  def __init__(self, cmd: list[str], env: dict[str, str], cwd: str | Path):
    self._proc = subprocess.Popen(cmd + ["serve"], env=env, cwd=cwd, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
    first = self._proc.stdout.readline()
    if not first.startswith('{"ready"'):
      raise RuntimeError(f"fork server did not start: {first!r} (exit {self._proc.poll()})")
    self._cond = threading.Condition()
    self._pids: list[int] = []
    self._codes: dict[int, int] = {}
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self._proc.stdout:
      msg = json.loads(line)
      with self._cond:
        if "pid" in msg:
          self._pids.append(msg["pid"])
        else:
          self._codes[msg["exit"]] = msg["code"]
        self._cond.notify_all()
    with self._cond:
      self._cond.notify_all()

  def start(self, stage: str, config: dict, point: str, stdout: str | Path,
            stderr: str | Path | None = None) -> ForkedProcess:
    """Forks a child running ``stage`` on ``config`` (kill ``point``); its stdout is appended to
    ``stdout``, its stderr to ``stderr`` (default: the same file)."""
    with self._cond:
      self._proc.stdin.write(json.dumps({"stage": stage, "config": config, "point": point,
                                         "stdout": str(stdout),
                                         "stderr": str(stderr or stdout)}) + "\n")
      self._proc.stdin.flush()
      if not self._cond.wait_for(lambda: self._pids or self._proc.poll() is not None, 60):
        raise RuntimeError("fork server: no child forked in 60 s")
      if not self._pids:
        raise RuntimeError(f"fork server exited with {self._proc.returncode}")
      return ForkedProcess(self, self._pids.pop(0))

  def code(self, pid: int, timeout: float | None) -> int | None:
    """Child ``pid``'s return code, waiting up to ``timeout`` s (None: still running)."""
    with self._cond:
      self._cond.wait_for(lambda: pid in self._codes or self._proc.poll() is not None, timeout)
      if pid not in self._codes and self._proc.poll() is not None:
        raise RuntimeError(f"fork server exited with {self._proc.returncode} before child {pid}")
      return self._codes.get(pid)

  def close(self) -> None:
    self._proc.stdin.close()
    try:
      self._proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
      self._proc.kill()
      self._proc.wait()


class ForkedProcess:
  """A child of the fork server, with the `subprocess.Popen` calls the fault matrix makes."""

  def __init__(self, server: ForkServer, pid: int):
    self.server, self.pid, self.returncode = server, pid, None

  def poll(self) -> int | None:
    if self.returncode is None:
      self.returncode = self.server.code(self.pid, 0)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    code = self.server.code(self.pid, timeout)
    if code is None:
      raise subprocess.TimeoutExpired(f"fork server child {self.pid}", timeout)
    self.returncode = code
    return code

  def communicate(self, timeout: float | None = None) -> tuple[None, None]:
    self.wait(timeout)
    return None, None
