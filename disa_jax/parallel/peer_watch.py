"""Every process of a multi-process run watches every other: a lost process stops the run, named.

JAX's distributed runtime notices a dead process only at its heartbeat timeout (100 s by default),
and then aborts the survivors with a log that names no process: a 2-process CPU run whose process 1
was SIGKILLed printed Gloo's "connection reset" at once but exited (-6) only after 71-74 s.

`start` (called by `disa_jax.parallel.distributed.initialize`) connects every pair of processes
with a TCP socket (each process's address goes through JAX's key-value store), and a daemon thread
on each process sends every peer one byte a second and reads theirs. A peer is lost when its
connection closes without the goodbye its process sends at a normal exit (killed, crashed, its host
gone), or when nothing came from it for ``timeout_s`` (hung, or the network between them down).
Then this process prints one line on stderr, its last whatever other threads are printing,

    error: process 1 of 2 (host gpu007, pid 4242) is lost: its connection closed without a goodbye
    (killed or crashed); process 0 stops too (DISA_HEARTBEAT_TIMEOUT_S=15) ...

and exits with `EXIT_CODE` at once: its next collective would hang or abort. A process whose
Python program ended with an uncaught exception tells its peers so, and they stop the same way,
naming it.

The timeout is ``DISA_HEARTBEAT_TIMEOUT_S`` (`timeout_from_env`, default `DEFAULT_TIMEOUT_S`);
JAX's own heartbeat timeout is set a few seconds above it (`jax_heartbeat_s`), so this line comes
first. Raise it where the network between hosts stalls for longer (docs/cluster.md).
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Mapping

from jax._src import distributed as jax_distributed

DEFAULT_TIMEOUT_S = 15.0
ENV = "DISA_HEARTBEAT_TIMEOUT_S"
EXIT_CODE = 75
_PING, _BYE, _FAILED = b".", b"B", b"F"
_KEY = "disa_peer_watch/{}"


def timeout_from_env(env: Mapping[str, str] | None = None) -> float:
  """``DISA_HEARTBEAT_TIMEOUT_S`` as seconds (> 2), else `DEFAULT_TIMEOUT_S`."""
  env = os.environ if env is None else env
  raw = env.get(ENV, "")
  if not raw:
    return DEFAULT_TIMEOUT_S
  try:
    value = float(raw)
  except ValueError:
    value = float("nan")
  if not value > 2 or value == float("inf"):
    raise ValueError(f"environment variable {ENV}={raw!r} must be a number of seconds > 2")
  return value


def jax_heartbeat_s(timeout_s: float) -> int:
  """JAX's heartbeat timeout for a watch of ``timeout_s``: 5 s later, so the watch names the lost
  process before JAX's runtime aborts without naming it."""
  return int(timeout_s) + 5


@dataclasses.dataclass
class _Peer:
  index: int
  host: str
  pid: int
  sock: socket.socket
  heard: float  # time.monotonic() of its last byte
  said_bye: bool = False


def _reachable_ip(coordinator: str) -> str:
  """This host's address on the route to the coordinator (what the other processes can reach)."""
  host, _, port = coordinator.rpartition(":")
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    s.connect((host.strip("[]"), int(port or 1)))  # UDP: no packet is sent
    return s.getsockname()[0]


def _recv_exact(sock: socket.socket, n: int) -> bytes:
  data = b""
  while len(data) < n:
    part = sock.recv(n - len(data))
    if not part:
      raise ConnectionError("closed during the peer-watch handshake")
    data += part
  return data


class PeerWatch:
  """The running watch of one process (see the module docstring)."""

  def __init__(self, client, process_id: int, num_processes: int, coordinator: str, *,
               timeout_s: float, connect_timeout_s: float = 300.0):
    self.me, self.n, self.timeout_s = process_id, num_processes, timeout_s
    self._failed = False
    server = socket.create_server(("", 0))
    host = socket.gethostname()
    client.key_value_set(_KEY.format(process_id), f"{_reachable_ip(coordinator)}:"
                         f"{server.getsockname()[1]}:{os.getpid()}:{host}")
    self.peers: dict[int, _Peer] = {}
    hello = struct.pack("<i", process_id)
    for j in range(process_id):  # connect to every lower id; the higher ones connect to us
      ip, port, pid, peer_host = client.blocking_key_value_get(
          _KEY.format(j), int(connect_timeout_s * 1000)).split(":", 3)
      sock = socket.create_connection((ip, int(port)), timeout=connect_timeout_s)
      sock.sendall(hello)
      self.peers[j] = _Peer(j, peer_host, int(pid), sock, time.monotonic())
    server.settimeout(connect_timeout_s)
    for _ in range(process_id + 1, num_processes):
      sock, _ = server.accept()
      sock.settimeout(connect_timeout_s)
      j = struct.unpack("<i", _recv_exact(sock, 4))[0]
      _, _, pid, peer_host = client.blocking_key_value_get(
          _KEY.format(j), int(connect_timeout_s * 1000)).split(":", 3)
      self.peers[j] = _Peer(j, peer_host, int(pid), sock, time.monotonic())
    server.close()
    for p in self.peers.values():
      p.sock.setblocking(False)
    self._hook = sys.excepthook
    sys.excepthook = self._excepthook
    atexit.register(self.say_goodbye)
    threading.Thread(target=self._run, name="disa-peer-watch", daemon=True).start()

  def _excepthook(self, *exc) -> None:
    self._failed = True
    self._hook(*exc)

  def say_goodbye(self) -> None:
    """At this process's normal exit: tells every peer it ended, and whether it failed."""
    for p in list(self.peers.values()):
      try:
        p.sock.send(_FAILED if self._failed else _BYE)
      except OSError:
        pass

  def _lost(self, p: _Peer, why: str) -> None:
    line = (f"error: process {p.index} of {self.n} (host {p.host}, pid {p.pid}) is lost: {why}; "
            f"process {self.me} stops too ({ENV}={self.timeout_s:g}; a rerun resumes from the last "
            "checkpoint)")
    _last_words(line)
    os._exit(EXIT_CODE)

  def _read(self, p: _Peer, now: float) -> None:
    try:
      data = p.sock.recv(4096)
    except (BlockingIOError, InterruptedError):
      return
    except OSError as e:
      data, why = b"", f"its connection failed ({e.strerror or e})"
    else:
      why = "its connection closed without a goodbye (killed or crashed)"
    if not data:
      if p.said_bye:
        p.sock.close()
        del self.peers[p.index]
        return
      self._lost(p, why)
    if _FAILED in data:
      self._lost(p, "its program stopped with an error (its log has the traceback)")
    p.heard, p.said_bye = now, p.said_bye or _BYE in data

  def _run(self) -> None:
    sent = 0.0
    while self.peers:
      ready, _, _ = select.select([p.sock for p in self.peers.values()], [], [], 0.5)
      now = time.monotonic()
      for p in [p for p in self.peers.values() if p.sock in ready]:
        self._read(p, now)
      if now - sent >= 1.0:
        sent = now
        for p in self.peers.values():
          try:
            p.sock.send(_PING)
          except (BlockingIOError, InterruptedError):
            pass
          except OSError:
            pass  # the read side names it
      for p in list(self.peers.values()):
        if not p.said_bye and now - p.heard > self.timeout_s:
          self._lost(p, f"nothing heard from it for {now - p.heard:.1f} s (hung, or the network "
                        "between the hosts is down)")


def start(process_id: int, num_processes: int, *, timeout_s: float) -> PeerWatch | None:
  """Starts this process's watch once `jax.distributed.initialize` has connected it (collective:
  every process calls it); None for a single process."""
  if num_processes < 2:
    return None
  state = jax_distributed.global_state
  return PeerWatch(state.client, process_id, num_processes, state.coordinator_address,
                   timeout_s=timeout_s)


def _last_words(line: str) -> None:
  """Writes `line` as the last line of stderr, whole, whatever the other threads are printing.

  When a peer dies, this process's main thread is often inside a collective that fails at the same
  moment, and its traceback (or XLA's log) is being written while this thread decides: fd 2 goes to
  /dev/null first, so nothing written after this line follows it, and the line starts on a line of
  its own (a leading newline ends any half-written one) in one write(2) to the original stderr.
  """
  # (No sys.stderr.flush(): it would wait for the main thread's write lock; stderr's complete lines
  # are out already, it being line-buffered, and a half line still in its buffer is dropped.)
  try:  # (an fd 2 already closed must not keep this thread from exiting the process)
    out = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    os.close(null)  # (fd 2 holds /dev/null now)
    os.write(out, f"\n{line}\n".encode())
    os.close(out)
  except OSError:
    pass
