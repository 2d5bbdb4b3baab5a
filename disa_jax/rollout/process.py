"""The generation process: a rollout engine in its own spawned process, driven through shared memory.

`RemoteEngine` (trainer side) spawns `_worker_main` with the `spawn` start method. Requests go
through a request `ShmRing`, results come back through a result `ShmRing`, weights through a
`ShmBlock` rewritten in place, and a small control block carries the worker's state, pid, a
heartbeat and, on failure, its traceback. `ProcessOptions` say how the process is run and watched;
`make_local_engine` builds the engine inside it (or in the calling process).

The worker's environment (`ProcessOptions.env`, and vLLM's defaults) is the environment the spawned
interpreter starts with: `spawn_environment` sets it in ``os.environ`` around ``Process.start()``
and restores it, so JAX (which reads ``JAX_PLATFORMS`` and its other flags when it is imported, and
may be imported while the child unpickles its target or re-imports the trainer's ``__main__``) sees
it before anything runs there.

Failure handling (never a hang):
* every call waits with a deadline (`timeout_s`) and checks, every ~50 ms, that the worker is alive
  and that its heartbeat is fresher than `heartbeat_timeout_s` (a stopped or wedged process stops
  beating). Death gives `GenerationProcessError` at once; a hang or a missed deadline kills the worker
  and raises `TimeoutError`. After either, the proxy is closed and later calls raise.
* shared-memory names are unlinked as soon as both sides have mapped them; before that, the worker's
  watchdog unlinks them if the trainer dies, and the trainer's watchdog if the worker dies. The worker
  also exits by itself when the trainer dies, so a `kill -9` of either side leaves nothing behind.
  One window remains: a trainer killed after creating the segments but before its worker has mapped
  them leaves names that no live process knows; the next `RemoteEngine` on the machine removes them
  (`shm.cleanup_stale_segments`: creator pid dead).
* what the engine itself creates in /dev/shm (vLLM's ``psm_*`` segments, ``sem.mp-*`` semaphores)
  is registered with a resource tracker private to the worker (`reaper`), which outlives a kill -9
  of the worker and removes it.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import multiprocessing as mp
import multiprocessing.connection
import os
import secrets
import signal
import threading
import time
import traceback
import weakref
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from disa_jax import config as config_lib
from disa_jax import codec, preemption, runtime
from disa_jax.rollout import flat_weights, reaper, shm
from disa_jax.rollout.jax_sampler import JaxSampler
from disa_jax.rollout.types import (MODEL_ENGINES, Completion, Engine, SamplingParams, check_kind,
                                    check_scalar_mapping, validate_prompts)
from disa_jax.rollout.vllm_engine import VllmEngine

_FINISH = ("stop", "length")
_CTL = shm.ControlBlock


class GenerationProcessError(RuntimeError):
  """The generation process died, failed to start, or reported an error."""


class GenerationProcessHung(TimeoutError):
  """The generation process stopped sending heartbeats."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessOptions:
  """How the generation process is run and watched (see `RemoteEngine`).

  Attributes:
    timeout_s: deadline of each `generate` / `update_weights` call (seconds).
    startup_timeout_s: deadline for the worker to build its engine.
    heartbeat_timeout_s: the worker is declared hung when its heartbeat is older than this.
    request_bytes: slot size of the request ring (the prompt tokens of one call must fit).
    result_bytes: slot size of the result ring (results are sent in as many chunks as needed).
    env: environment variables the worker's interpreter starts with (any name; int and float
      values are written as strings): set before anything, JAX included, is imported there
      (`spawn_environment`).
    copy_threads: threads that copy a weight update into shared memory (`shm.copy_array`);
      0 = min(8, CPU count).
  """
  timeout_s: float = 3600.0
  startup_timeout_s: float = 900.0
  heartbeat_timeout_s: float = 60.0
  request_bytes: int = 16 << 20
  result_bytes: int = 32 << 20
  env: dict = dataclasses.field(default_factory=dict)
  copy_threads: int = 0

  def __post_init__(self):
    env = check_scalar_mapping(self.env, "process.env", allow_none=False)
    for k, v in env.items():
      if isinstance(v, bool):
        raise ValueError(f"process.env.{k} must be a string or number (write 1 or 0), got {v!r}")
    object.__setattr__(self, "env", {k: str(v) for k, v in env.items()})
    for name in ("timeout_s", "startup_timeout_s", "heartbeat_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"process.{name} must be > 0, got {getattr(self, name)!r}")
    for name in ("request_bytes", "result_bytes"):
      if getattr(self, name) < 4096:
        raise ValueError(f"process.{name} must be >= 4096, got {getattr(self, name)!r}")
    config_lib.check_count(self.copy_threads, "process.copy_threads", "0 = min(8, CPU count)")


def make_local_engine(kind: str, model_path: str, **options: Any) -> Engine:
  """Builds an engine in this process: 'jax' (`JaxSampler`) or 'vllm' (`VllmEngine`)."""
  check_kind(kind, "engine kind", MODEL_ENGINES)
  if kind == "jax":
    return JaxSampler.from_pretrained(model_path, **options)
  return VllmEngine(model_path, **options)


_SPAWN_ENV_LOCK = threading.Lock()


@contextlib.contextmanager
def spawn_environment(env: Mapping[str, str]) -> Iterator[None]:
  """``os.environ`` with ``env`` set for the duration, then restored (a name it added removed).

  A process spawned inside (``Process.start()`` with the `spawn` start method execs a fresh
  interpreter with this process's environment) starts with ``env``: it is there before the child
  runs any Python, so before it imports JAX. A lock serialises the callers of this process; other
  threads that read ``os.environ`` meanwhile see ``env`` too, so hold it only around the start.

  Args:
    env: variable name -> string value.
  """
  bad = {k: v for k, v in env.items() if not (isinstance(k, str) and isinstance(v, str))}
  if bad:
    raise TypeError(f"spawn_environment needs str names and values, got {bad!r}")
  with _SPAWN_ENV_LOCK:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
      yield
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
  kind: str
  model_path: str
  engine_kwargs: dict
  parent_pid: int
  ctl_name: str
  req_name: str
  res_name: str
  result_bytes: int


# ----------------------------------------------------------------------------------------------
# Wire format of generate results.
# ----------------------------------------------------------------------------------------------


def _pack_completions(comps: Sequence[Completion], with_raw: bool) -> dict[str, np.ndarray]:
  arrays = {
      "lengths": np.array([len(c.token_ids) for c in comps], np.int64),
      "finish": np.array([_FINISH.index(c.finish_reason) for c in comps], np.int8),
      "token_ids": np.concatenate([c.token_ids for c in comps] or [np.zeros(0, np.int32)]),
      "logprobs": np.concatenate([c.logprobs for c in comps] or [np.zeros(0, np.float32)]),
  }
  if with_raw:
    arrays["raw_logprobs"] = np.concatenate([c.raw_logprobs for c in comps]
                                            or [np.zeros(0, np.float32)])
  return arrays


def _unpack_completions(arrays: Mapping[str, np.ndarray]) -> list[Completion]:
  ends = np.cumsum(arrays["lengths"])
  starts = ends - arrays["lengths"]
  raw = arrays.get("raw_logprobs")
  return [
      Completion(token_ids=np.array(arrays["token_ids"][s:e]),
                 logprobs=np.array(arrays["logprobs"][s:e]),
                 raw_logprobs=None if raw is None else np.array(raw[s:e]),
                 finish_reason=_FINISH[int(f)])
      for s, e, f in zip(starts, ends, arrays["finish"])
  ]


def _chunk_completions(comps: list[Completion], max_bytes: int) -> list[list[Completion]]:
  """Splits completions into groups whose packed size stays below `max_bytes`."""
  chunks, cur, cur_bytes = [], [], 0
  for c in comps:
    nbytes = 12 * len(c.token_ids) + 64
    if cur and cur_bytes + nbytes > max_bytes:
      chunks.append(cur)
      cur, cur_bytes = [], 0
    cur.append(c)
    cur_bytes += nbytes
  chunks.append(cur)
  return chunks


# ----------------------------------------------------------------------------------------------
# Worker side.
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _encoded_layout(layout: flat_weights.FlatLayout) -> dict:
  """A flat push's layout as it travels (encoded once per layout; every push of a run has the
  same)."""
  return codec.encode(layout)


def _worker_main(spec: _WorkerSpec) -> None:
  """Entry point of the generation process."""
  # The trainer saves on SIGTERM / SIGUSR1, then closes this process; one that arrived while this
  # process started (blocked: `preemption.shielded_start`) is dropped here.
  preemption.ignore_in_child()
  # Before anything registers a segment or semaphore: a tracker that survives a kill -9 of this
  # process and removes what vLLM's processes registered (`reaper`).
  reaper.use_private_resource_tracker()
  if spec.kind == "jax":  # before JAX's threads exist (vLLM keeps glibc's defaults)
    runtime.tune_host_allocator()
  ctl = shm.ControlBlock.attach(spec.ctl_name)
  known_names = {spec.ctl_name, spec.req_name, spec.res_name}
  req = shm.ShmRing.attach(spec.req_name)
  res = shm.ShmRing.attach(spec.res_name)
  ctl.pid, ctl.heartbeat = os.getpid(), time.monotonic()
  ctl.state = _CTL.ATTACHED

  def watchdog():
    while True:
      ctl.heartbeat = time.monotonic()  # system-wide on Linux: the trainer reads the same clock
      if os.getppid() != spec.parent_pid or not shm._pid_alive(spec.parent_pid):  # pylint: disable=protected-access
        for name in list(known_names):
          shm.unlink_segment(name)
        os._exit(70)  # The trainer is gone: nobody will read our results.
      time.sleep(0.1)

  threading.Thread(target=watchdog, name="disa-rollout-watchdog", daemon=True).start()

  try:
    engine = make_local_engine(spec.kind, spec.model_path, **spec.engine_kwargs)
  except BaseException:  # pylint: disable=broad-except
    ctl.fail(traceback.format_exc())
    os._exit(1)
  ctl.state = _CTL.READY

  weights: shm.ShmBlock | None = None
  layout: tuple[dict, flat_weights.FlatLayout] | None = None  # the last flat push's, as sent
  while True:
    meta, arrays = req.get()
    rid, cmd = meta["id"], meta["cmd"]
    try:
      if cmd == "close":
        res.put({"id": rid, "ok": True, "last": True})
        break
      if cmd == "ping":
        res.put({"id": rid, "ok": True, "last": True, "pid": os.getpid()})
      elif cmd == "generate":
        params = codec.decode(SamplingParams, meta["params"], "params")
        ends = np.cumsum(arrays["lengths"])
        prompts = [arrays["tokens"][e - n:e] for e, n in zip(ends, arrays["lengths"])]
        t0 = time.perf_counter()
        out = engine.generate(prompts, params)
        engine_s = time.perf_counter() - t0
        flat = [c for per_prompt in out for c in per_prompt]
        chunks = _chunk_completions(flat, spec.result_bytes // 2)
        for k, chunk in enumerate(chunks):
          res.put({"id": rid, "ok": True, "last": k == len(chunks) - 1, "engine_s": engine_s},
                  _pack_completions(chunk, params.return_raw_logprobs))
      elif cmd == "update_weights":
        if weights is None or weights.name != meta["block"]:
          if weights is not None:
            known_names.discard(weights.name)
            weights.close(unlink=True)
          weights = shm.ShmBlock.attach(meta["block"])
          known_names.add(weights.name)
        _, views = weights.read()
        if "flat" in meta:  # a flat push: its buckets, laid out by the trainer's layout
          if layout is None or meta["flat"] != layout[0]:  # decoded once while it is the same
            layout = (meta["flat"], codec.decode(flat_weights.FlatLayout, meta["flat"], "flat"))
          views = flat_weights.FlatWeights(layout[1], [
              views[f"b{i}"] for i in range(len(layout[1].bucket_sizes))])
        t0 = time.perf_counter()
        engine.update_weights(views)
        load_s = time.perf_counter() - t0
        del views
        res.put({"id": rid, "ok": True, "last": True, "load_s": load_s})
      else:
        raise ValueError(f"unknown generation-process command {cmd!r}")
    except BaseException:  # pylint: disable=broad-except
      res.put({"id": rid, "ok": False, "last": True, "error": traceback.format_exc()})
  engine.close()
  ctl.state = _CTL.EXITED
  if weights is not None:
    weights.close(unlink=True)
  req.close(unlink=True)
  res.close(unlink=True)


# ----------------------------------------------------------------------------------------------
# Trainer side.
# ----------------------------------------------------------------------------------------------


class RemoteEngine:
  """An `Engine` proxy that runs the real engine in a spawned generation process.

  Args:
    kind: one of ``MODEL_ENGINES``.
    model_path: local HF checkpoint directory.
    options: the engine's constructor options (passed to it inside the worker).
    process: how the generation process is run and watched (`ProcessOptions`).
  """

  def __init__(self, kind: str, model_path: str, *, options: Mapping[str, Any] | None = None,
               process: ProcessOptions = ProcessOptions()):
    check_kind(kind, "RemoteEngine kind", MODEL_ENGINES)
    self.kind = kind
    self.timeout_s = process.timeout_s
    self.heartbeat_timeout_s = process.heartbeat_timeout_s
    self._lock = threading.Lock()
    self._closed = False
    self._closed_why: str | None = None  # the failure that closed it (`_closed_error`)
    self._next_id = 0
    self._weights: shm.ShmBlock | None = None
    self._weights_count = 0
    # Threads copying weights into shared memory (`ProcessOptions.copy_threads`), for arrays of at
    # least `copy_min_bytes` (a flat push's buckets; `shm.copy_array`).
    self.copy_threads = process.copy_threads or min(8, os.cpu_count() or 1)
    self.copy_min_bytes = shm.MIN_THREADED_BYTES
    # Timing of the last update_weights: bytes, copy_s (into shared memory), load_s (engine's own load
    # in the worker), total_s (call to return).
    self.last_sync: dict[str, float] = {}
    # Timing of the last generate: engine_s (the engine's own generate in the worker), total_s
    # (call to return: the rest is the request's and the results' way through shared memory).
    self.last_generate: dict[str, float] = {}
    self._names: set[str] = set()
    shm.cleanup_stale_segments()

    self._token = secrets.token_hex(4)
    self._ctl = shm.ControlBlock.create(shm.segment_name("ctl", self._token))
    self._names.add(self._ctl.name)
    self._req = shm.ShmRing.create(shm.segment_name("req", self._token), 2, process.request_bytes)
    self._names.add(self._req.name)
    self._res = shm.ShmRing.create(shm.segment_name("res", self._token), 4, process.result_bytes)
    self._names.add(self._res.name)

    worker_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
                  "TOKENIZERS_PARALLELISM": "false"}
    worker_env = {k: os.environ.get(k, v) for k, v in worker_env.items()}
    worker_env.update(process.env)
    spec = _WorkerSpec(kind=kind, model_path=str(model_path), engine_kwargs=dict(options or {}),
                       parent_pid=os.getpid(), ctl_name=self._ctl.name, req_name=self._req.name,
                       res_name=self._res.name, result_bytes=self._res.slot_bytes)
    ctx = mp.get_context("spawn")
    # Not daemonic: a daemonic process may not start children (vLLM may). Shutdown is ours: close(),
    # atexit, and the worker's own watchdog when this process dies.
    self._proc = ctx.Process(target=_worker_main, args=(spec,), name=f"disa-rollout-{kind}",
                             daemon=False)
    self.startup_s = float("nan")
    t0 = time.monotonic()
    # The worker starts with its env (before JAX is imported) and with SIGTERM / SIGUSR1 blocked
    # until it ignores them (a signal to the whole job while it starts must not kill it).
    with spawn_environment(worker_env), preemption.shielded_start():
      self._proc.start()
    self._finalizer = weakref.finalize(self, RemoteEngine._cleanup, self._proc, self._names)
    # Registered now, i.e. after multiprocessing's own exit hook, so it runs before that hook joins
    # the (non-daemonic) worker at interpreter exit.
    atexit.register(self._finalizer)
    threading.Thread(target=RemoteEngine._watch_worker, args=(self._proc, self._names),
                     name="disa-rollout-parent-watchdog", daemon=True).start()
    try:
      self._wait_startup(process.startup_timeout_s)
    except BaseException:
      self._abort()
      raise
    self.startup_s = time.monotonic() - t0

  # -- lifecycle ---------------------------------------------------------------------------------

  @property
  def pid(self) -> int | None:
    return self._proc.pid

  @property
  def segment_names(self) -> list[str]:
    return sorted(self._names)

  @staticmethod
  def _cleanup(proc: mp.Process, names: set[str]) -> None:
    if proc.is_alive():
      proc.kill()
      proc.join(5.0)
    for name in list(names):
      shm.unlink_segment(name)

  @staticmethod
  def _watch_worker(proc: mp.Process, names: set[str]) -> None:
    """Unlinks our names when the worker exits (covers the windows before they are unlinked)."""
    mp.connection.wait([proc.sentinel])
    for name in list(names):
      shm.unlink_segment(name)

  def _unlink_shared_names(self) -> None:
    for name in (self._ctl.name, self._req.name, self._res.name):
      shm.unlink_segment(name)
      self._names.discard(name)

  def _wait_startup(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
      state = self._ctl.state
      if state >= _CTL.ATTACHED:
        self._unlink_shared_names()  # both sides have them mapped now
      if state == _CTL.READY:
        return
      if state == _CTL.FAILED:
        raise GenerationProcessError(f"{self.kind} generation process failed to start:\n"
                                     f"{self._ctl.error()}")
      if not self._proc.is_alive():
        raise GenerationProcessError(f"{self.kind} generation process (pid {self._proc.pid}) exited "
                                     f"with code {self._proc.exitcode} during startup")
      if time.monotonic() > deadline:
        raise TimeoutError(f"{self.kind} generation process did not start within {timeout} s")
      time.sleep(0.01)

  def _death(self) -> str:
    """How the worker ended: ``died with exit code -9 (SIGKILL)``."""
    code = self._proc.exitcode
    try:
      name = f" ({signal.Signals(-code).name})" if code is not None and code < 0 else ""
    except ValueError:
      name = ""
    return f"{self.kind} generation process (pid {self._proc.pid}) died with exit code {code}{name}"

  def _check_alive(self) -> None:
    if not self._proc.is_alive():
      raise GenerationProcessError(self._death())
    age = time.monotonic() - self._ctl.heartbeat  # a wall-clock step changes nothing
    if age > self.heartbeat_timeout_s:
      raise GenerationProcessHung(f"{self.kind} generation process (pid {self._proc.pid}) is hung: no "
                         f"heartbeat for {age:.1f} s (heartbeat_timeout_s="
                         f"{self.heartbeat_timeout_s})")

  def _abort(self, why: BaseException | None = None) -> None:
    """Kills the worker and releases everything; used on any failure (``why``: kept for the
    error of every later call)."""
    self._closed = True
    if why is not None and self._closed_why is None:
      self._closed_why = str(why).splitlines()[0] if str(why) else type(why).__name__
    RemoteEngine._cleanup(self._proc, self._names)
    self._release_local()

  def _closed_error(self) -> GenerationProcessError:
    """The error of a call after `close` or a failure: it names the failure (a later call of an
    asynchronous run must not hide why the process ended)."""
    why = self._closed_why
    if why is None and not self._proc.is_alive() and self._proc.exitcode not in (None, 0):
      why = self._death()
    return GenerationProcessError(f"{self.kind} generation process is closed"
                                  + (f": {why}" if why else ""))

  def _release_local(self) -> None:
    if self._weights is not None:
      self._weights.close(unlink=True)
      self._weights = None
    for seg in (self._req, self._res, self._ctl):
      seg.close(unlink=True)
    self._finalizer.detach()
    atexit.unregister(self._finalizer)

  def close(self) -> None:
    """Asks the worker to exit (kills it if it does not within 30 s); idempotent."""
    with self._lock:
      if self._closed:
        return
      try:
        self._call("close", {}, {}, timeout=30.0)
        self._proc.join(30.0)
      except (GenerationProcessError, TimeoutError):
        pass
      self._abort()

  def __enter__(self) -> "RemoteEngine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- requests ----------------------------------------------------------------------------------

  def _call(self, cmd: str, meta: dict, arrays: dict, timeout: float | None = None
            ) -> list[tuple[dict, dict[str, np.ndarray]]]:
    if self._closed:
      raise self._closed_error()
    timeout = self.timeout_s if timeout is None else timeout
    rid = self._next_id
    self._next_id += 1
    deadline = time.monotonic() + timeout
    try:
      self._req.put({"id": rid, "cmd": cmd, **meta}, arrays, timeout=timeout,
                    check=self._check_alive)
      parts = []
      while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise TimeoutError(f"{self.kind} generation process did not answer {cmd!r} within "
                             f"{timeout} s (timeout_s)")
        try:
          m, a = self._res.get(timeout=remaining, check=self._check_alive)
        except GenerationProcessHung:
          raise
        except TimeoutError as e:
          raise TimeoutError(f"{self.kind} generation process did not answer {cmd!r} within "
                             f"{timeout} s (timeout_s)") from e
        if m["id"] != rid:
          raise GenerationProcessError(f"result for request {m['id']} while waiting for {rid}")
        if not m["ok"]:
          parts = None
          error = m["error"]
          break
        parts.append((m, a))
        if m["last"]:
          break
    except (GenerationProcessError, TimeoutError) as e:
      if cmd != "close":
        self._abort(e)
      raise
    if parts is None:
      raise GenerationProcessError(f"{cmd!r} failed in the {self.kind} generation process:\n"
                                   f"{error}")
    return parts

  def ping(self) -> int:
    """Round trip through the worker; returns its pid."""
    with self._lock:
      return int(self._call("ping", {}, {})[0][0]["pid"])

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """See `Engine.generate`; returns `[P][n]` completions."""
    prompts = validate_prompts(prompt_token_ids)
    arrays = {"lengths": np.array([len(p) for p in prompts], np.int64),
              "tokens": np.concatenate(prompts)}
    t0 = time.perf_counter()
    with self._lock:
      parts = self._call("generate", {"params": codec.encode(params)}, arrays)
    flat = [c for _, a in parts for c in _unpack_completions(a)]
    if len(flat) != len(prompts) * params.n:
      raise GenerationProcessError(f"expected {len(prompts) * params.n} completions, "
                                   f"got {len(flat)}")
    self.last_generate = {"engine_s": float(parts[-1][0]["engine_s"]),
                          "total_s": time.perf_counter() - t0}
    return [flat[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    """Copies `state_dict` (HF names/layouts, or a flat push's buckets, `flat_weights`) into
    shared memory (``copy_threads`` threads for arrays of ``copy_min_bytes`` or more) and loads
    it in the worker."""
    request = {}
    if isinstance(state_dict, flat_weights.FlatWeights):
      arrays = {f"b{i}": b for i, b in enumerate(state_dict.buffers)}
      request = {"flat": _encoded_layout(state_dict.layout)}
    else:
      arrays = {k: np.asarray(v) for k, v in state_dict.items()}
    nbytes = shm.message_nbytes({}, arrays)
    with self._lock:
      if self._closed:
        raise self._closed_error()
      if self._weights is None or self._weights.size < nbytes:
        if self._weights is not None:
          self._weights.close(unlink=True)
          self._names.discard(self._weights.name)
        self._weights_count += 1
        self._weights = shm.ShmBlock.create(
            shm.segment_name(f"w{self._weights_count}", self._token), nbytes)
        self._names.add(self._weights.name)
      t0 = time.perf_counter()
      self._weights.write({}, arrays, self.copy_threads, self.copy_min_bytes)
      t1 = time.perf_counter()
      name = self._weights.name
      try:
        meta = self._call("update_weights", {"block": name, **request}, {})[0][0]
      finally:  # The worker has it mapped now (or failed): drop the name so that nothing can leak.
        shm.unlink_segment(name)
        self._names.discard(name)
      self.last_sync = {"bytes": nbytes, "copy_s": t1 - t0, "load_s": meta["load_s"],
                        "total_s": time.perf_counter() - t0}
