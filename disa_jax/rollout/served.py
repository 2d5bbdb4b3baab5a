"""A local ``vllm serve`` (vLLM's OpenAI-compatible server) that leaves nothing behind.

`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 in its own session
(the API server and its engine-core child), waits for ``GET /v1/models``, and stops it either
gracefully (`stop`: SIGTERM, then SIGKILL after a grace period) or as a crash (`kill`: SIGKILL to
the whole group). Either way the /dev/shm names its processes had mapped are removed afterwards
(`reaper.ProcessTreeShm`): a group kill also kills vLLM's resource tracker, which would otherwise
have removed them. Used by the tests of the OpenAI engine and of the diversity judge; usable to
serve a proposal for Stage 1 (``engine.kind='openai'``) on the same machine.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Sequence

from disa_jax.rollout import reaper


class VllmServerError(RuntimeError):
  """The server exited or did not become ready."""


class VllmServer:
  """One ``vllm serve`` process group on 127.0.0.1.

  Args:
    model_path: local HF checkpoint directory.
    port: TCP port on 127.0.0.1.
    log_path: file that receives the server's stdout and stderr (appended).
    served_name: the model name clients send (``--served-model-name``).
    args: further server arguments (e.g. ``("--dtype", "float32", "--enforce-eager")``).
    env: environment variables added to this process's for the server.
  """

  def __init__(self, model_path: str, port: int, log_path: str, *, served_name: str,
               args: Sequence[str] = (), env: dict[str, str] | None = None):
    self.model_path, self.port, self.log_path = str(model_path), int(port), str(log_path)
    self.served_name = served_name
    self.args = tuple(str(a) for a in args)
    self.env = dict(env or {})
    self.proc: subprocess.Popen | None = None
    self._shm: reaper.ProcessTreeShm | None = None

  @property
  def url(self) -> str:
    """The OpenAI base URL (``.../v1``)."""
    return f"http://127.0.0.1:{self.port}/v1"

  def start(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      raise VllmServerError(f"vLLM server on port {self.port} is already running")
    env = dict(os.environ, **self.env)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
           "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port",
           str(self.port), *self.args]
    with open(self.log_path, "ab") as log:
      self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    self._shm = reaper.ProcessTreeShm(self.proc.pid)

  def wait_ready(self, timeout_s: float = 600.0) -> float:
    """Seconds until ``GET /v1/models`` answers; raises `VllmServerError` with the log's tail."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
      if self.proc is None or self.proc.poll() is not None:
        code = None if self.proc is None else self.proc.returncode
        raise VllmServerError(f"vLLM server exited with {code}:\n{self.log_tail()}")
      try:
        with urllib.request.urlopen(f"{self.url}/models", timeout=5) as r:
          if r.status == 200:
            self._shm.record()
            return time.monotonic() - t0
      except OSError:
        time.sleep(1.0)
    raise VllmServerError(f"vLLM server not ready after {timeout_s} s:\n{self.log_tail()}")

  def record_shm(self) -> set[str]:
    """Records (and returns) the /dev/shm names the server's processes map now."""
    return set() if self._shm is None else self._shm.record()

  def kill(self) -> list[str]:
    """SIGKILL to the server's process group, as a crash; returns the /dev/shm names removed."""
    return self._end(signal.SIGKILL, grace_s=0.0)

  def stop(self, grace_s: float = 30.0) -> list[str]:
    """SIGTERM to the group, SIGKILL after ``grace_s``; returns the /dev/shm names removed."""
    return self._end(signal.SIGTERM, grace_s=grace_s)

  def _end(self, sig: int, grace_s: float) -> list[str]:
    if self.proc is None:
      return []
    proc, shm, self.proc, self._shm = self.proc, self._shm, None, None
    if proc.poll() is None:
      shm.record()
      pgid = proc.pid
      _killpg(pgid, sig)
      try:
        proc.wait(timeout=grace_s if sig != signal.SIGKILL else 60)
      except subprocess.TimeoutExpired:
        _killpg(pgid, signal.SIGKILL)
        proc.wait(timeout=60)
      _wait_group_gone(pgid, 30.0)
    return shm.release()

  def log_tail(self, n: int = 4000) -> str:
    with open(self.log_path, "rb") as f:
      return f.read().decode(errors="replace")[-n:]


def _killpg(pgid: int, sig: int) -> None:
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:
    pass


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
  """Waits until no process of group ``pgid`` is left (the engine core exits after the leader)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    try:
      os.killpg(pgid, 0)
    except ProcessLookupError:
      return
    time.sleep(0.1)
  _killpg(pgid, signal.SIGKILL)
