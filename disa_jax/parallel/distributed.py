"""Multi-process (multi-host) runs on JAX's distributed runtime.

One JAX process runs per host (or per GPU); `initialize` connects them through
`jax.distributed.initialize`, taking the coordinator address, the process count and this process's
id from the launcher's environment:

- explicit variables (any launcher, e.g. ``torchrun``-style wrappers or a hand-written ``ssh`` loop):
  ``DISA_COORDINATOR`` (``host:port``), ``DISA_NUM_PROCESSES``, ``DISA_PROCESS_ID`` and optionally
  ``DISA_LOCAL_PROCESS_ID`` / ``DISA_LOCAL_DEVICE_IDS`` (comma-separated);
- SLURM (``srun``): ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, the first host of
  ``SLURM_STEP_NODELIST`` / ``SLURM_JOB_NODELIST`` as coordinator (port ``DISA_COORDINATOR_PORT``,
  default 12356). With several tasks per node (one process per GPU) each process sees only
  GPU ``SLURM_LOCALID`` (``local_device_ids``); ``DISA_LOCAL_DEVICE_IDS`` overrides the GPUs a
  process drives (one process per host that leaves some GPUs to the generation process);
- Cloud TPU pods (the same command on every worker): ``TPU_WORKER_HOSTNAMES`` / ``TPU_WORKER_ID``
  or ``CLOUD_TPU_TASK_ID`` present -> ``jax.distributed.initialize()`` with no arguments, which
  reads the TPU metadata itself;
- nothing of the above: a single process, no distributed runtime.

After `initialize`, every process builds the same global `Mesh` over ``jax.devices()`` and runs the
same jitted program. Data: each process holds the rows of the global batch that live on its own
devices and hands them to `global_batch` (``jax.make_array_from_process_local_data``);
`process_rows` says which rows those are. Checkpoints: every process calls the same
`disa_jax.checkpoint.CheckpointManager` methods on a directory all hosts can reach (orbax writes each
process's shards and process 0 finalises). Logs and reports: only `is_main_process()`. Weights for
the generation side: `disa_jax.models.host_state_dict` gathers the (possibly cross-host sharded)
parameters into a full host copy on every process (`replicate_to_hosts`), which the host's leader
(`is_host_leader()`) pushes into its local generation process (`disa_jax.rollout.multihost`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import zlib
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax.parallel import peer_watch

DEFAULT_PORT = 12356


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
  """How this process joins a multi-process run.

  Attributes:
    source: 'env' | 'slurm' | 'tpu' | 'single' (which variables it came from).
    coordinator_address: ``host:port`` of process 0's coordinator (None: JAX finds it, TPU).
    num_processes: total number of JAX processes (None: JAX finds it, TPU).
    process_id: this process's id in ``[0, num_processes)`` (None: JAX finds it, TPU).
    local_process_id: this process's index among the processes on its host.
    local_device_ids: the accelerator ids this process drives (None: all visible ones).
  """
  source: str
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_process_id: int = 0
  local_device_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.source not in ("env", "slurm", "tpu", "single"):
      raise ValueError(f"LaunchSpec.source must be env|slurm|tpu|single, got {self.source!r}")
    if self.num_processes is not None and self.num_processes < 1:
      raise ValueError(f"LaunchSpec.num_processes must be >= 1, got {self.num_processes!r}")
    if (self.process_id is not None and self.num_processes is not None
        and not 0 <= self.process_id < self.num_processes):
      raise ValueError(f"LaunchSpec.process_id={self.process_id!r} is outside "
                       f"[0, num_processes={self.num_processes})")

  @property
  def is_distributed(self) -> bool:
    return self.source == "tpu" or (self.num_processes or 1) > 1


def first_slurm_host(nodelist: str) -> str:
  """The first host name of a SLURM node list (``'gpu[003-005,9],cpu1'`` -> ``'gpu003'``)."""
  m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
  if not m or not m.group(1):
    raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
  prefix, ranges = m.group(1), m.group(3)
  if ranges is None:
    return prefix
  first = ranges.split(",")[0].split("-")[0]
  return prefix + first


def _int_env(env: Mapping[str, str], name: str) -> int:
  value = env[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchSpec:
  """Reads the launcher's environment (see the module docstring for the precedence); a malformed
  ``DISA_HEARTBEAT_TIMEOUT_S`` is refused here, with the launch's other variables, before any
  config is read."""
  env = os.environ if env is None else env
  peer_watch.timeout_from_env(env)
  if "DISA_COORDINATOR" in env:
    ids = env.get("DISA_LOCAL_DEVICE_IDS")
    return LaunchSpec(
        "env", env["DISA_COORDINATOR"], _int_env(env, "DISA_NUM_PROCESSES"),
        _int_env(env, "DISA_PROCESS_ID"),
        _int_env(env, "DISA_LOCAL_PROCESS_ID") if "DISA_LOCAL_PROCESS_ID" in env else 0,
        tuple(int(i) for i in ids.split(",")) if ids else None)
  if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
      raise ValueError("SLURM launch without SLURM_STEP_NODELIST / SLURM_JOB_NODELIST")
    ntasks = _int_env(env, "SLURM_NTASKS")
    nnodes = _int_env(env, "SLURM_NNODES") if "SLURM_NNODES" in env else 1
    local = _int_env(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    port = _int_env(env, "DISA_COORDINATOR_PORT") if "DISA_COORDINATOR_PORT" in env else DEFAULT_PORT
    per_gpu = ntasks > nnodes  # several tasks per node: one process per GPU
    visible = [v for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
    # One process per GPU: drive GPU SLURM_LOCALID, unless SLURM already bound one GPU per task.
    device_ids = (local,) if per_gpu and len(visible) != 1 else None
    if env.get("DISA_LOCAL_DEVICE_IDS"):  # e.g. keep some GPUs of the host for generation
      device_ids = tuple(int(i) for i in env["DISA_LOCAL_DEVICE_IDS"].split(","))
    return LaunchSpec("slurm", f"{first_slurm_host(nodelist)}:{port}", ntasks,
                      _int_env(env, "SLURM_PROCID"), local, device_ids)
  if "TPU_WORKER_HOSTNAMES" in env or "CLOUD_TPU_TASK_ID" in env:
    return LaunchSpec("tpu")
  return LaunchSpec("single", num_processes=1, process_id=0)


_SPEC: LaunchSpec | None = None


def initialize(spec: LaunchSpec | None = None, *, cpu_collectives: str = "gloo",
               initialization_timeout_s: int = 300,
               heartbeat_timeout_s: float | None = None) -> LaunchSpec:
  """Joins the multi-process run described by ``spec`` (default: `detect_launch()`).

  Call before anything touches a JAX backend. Idempotent: a second call returns the first spec.
  Every process then watches every other (`disa_jax.parallel.peer_watch`): a process lost is
  named in one line and stops the others within ``heartbeat_timeout_s`` (at once when it was
  killed); JAX's own heartbeat timeout is set a few seconds above it.

  Args:
    spec: the launch; None reads the environment.
    cpu_collectives: CPU collective implementation for CPU-only runs (tests): 'gloo' or 'mpi'.
    initialization_timeout_s: how long to wait for every process to connect.
    heartbeat_timeout_s: how long a silent process counts as alive (None:
      ``DISA_HEARTBEAT_TIMEOUT_S``, default `peer_watch.DEFAULT_TIMEOUT_S`).

  Returns:
    The spec used.
  """
  global _SPEC
  if _SPEC is not None:
    return _SPEC
  spec = detect_launch() if spec is None else spec
  if spec.is_distributed:
    timeout = (peer_watch.timeout_from_env() if heartbeat_timeout_s is None
               else float(heartbeat_timeout_s))
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    timeouts = dict(initialization_timeout=initialization_timeout_s,
                    heartbeat_timeout_seconds=peer_watch.jax_heartbeat_s(timeout))
    if spec.source == "tpu":
      jax.distributed.initialize(**timeouts)
    else:
      jax.distributed.initialize(spec.coordinator_address, spec.num_processes, spec.process_id,
                                 local_device_ids=list(spec.local_device_ids)
                                 if spec.local_device_ids is not None else None, **timeouts)
    peer_watch.start(jax.process_index(), jax.process_count(), timeout_s=timeout)
  _SPEC = spec
  return spec


def is_main_process() -> bool:
  """True on process 0, the only one that writes logs, reports and exports."""
  return jax.process_index() == 0


def is_host_leader() -> bool:
  """True on the first process of each host: the one that owns the host's generation process."""
  return (_SPEC.local_process_id if _SPEC is not None else 0) == 0


def process_rows(sharding: NamedSharding, global_shape: tuple[int, ...], axis: int = 0) -> slice:
  """The contiguous range of ``axis`` this process's devices hold under ``sharding``.

  Args:
    sharding: the global batch sharding (e.g. ``PartitionSpec(None, ('data', 'fsdp'))``).
    global_shape: the global array shape.
    axis: the sharded batch axis.

  Returns:
    ``slice(start, stop)``; the rows this process must feed to `global_batch`.

  Raises:
    ValueError: the process's devices hold a non-contiguous set of rows (a mesh whose device
      order interleaves processes along the batch axes).
  """
  index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
  spans = sorted({(idx[axis].start or 0,
                   global_shape[axis] if idx[axis].stop is None else idx[axis].stop)
                  for idx in index_map.values()})
  start, stop = spans[0]
  for s, e in spans[1:]:
    if s > stop:
      raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {spans} of axis "
                       f"{axis}; build the mesh with each process's devices adjacent")
    stop = max(stop, e)
  return slice(start, stop)


def global_batch(local: Mapping[str, np.ndarray], sharding: NamedSharding,
                 global_leading: Mapping[str, tuple[int, ...]] | None = None,
                 axis: int = 0) -> dict[str, jax.Array]:
  """Assembles global arrays from each process's own rows (``jax.make_array_from_process_local_data``).

  Args:
    local: field -> this process's rows (the `process_rows` range of ``axis``).
    sharding: the global batch sharding, used for every field (its spec applies to the leading
      dims; trailing dims are replicated).
    global_leading: field -> global shape; default: ``axis`` scaled by the process count.
    axis: the batch axis.

  Returns:
    field -> global `jax.Array`.
  """
  out = {}
  for k, v in local.items():
    v = np.asarray(v)
    if global_leading is not None and k in global_leading:
      shape = tuple(global_leading[k])
    else:
      shape = list(v.shape)
      shape[axis] *= jax.process_count()  # every process feeds the same number of rows
      shape = tuple(shape)
    out[k] = jax.make_array_from_process_local_data(sharding, v, shape)
  return out


def shard_global_batch(batch: Any, sharding: Any, axis: int = 0) -> Any:
  """`global_batch` for a batch (any pytree of arrays) every process holds in full: each process
  feeds only its own rows of ``axis``.

  ``sharding`` is one `NamedSharding` for every leaf, or a pytree of them matching ``batch`` (a
  prefix of it). In a single process every row is this process's: the whole tree goes to its
  devices in one batched ``jax.device_put`` (the same arrays, without a per-leaf placement plan).
  """
  if jax.process_count() == 1:
    return jax.device_put(jax.tree.map(np.asarray, batch), sharding)

  def one(s, v):
    v = np.asarray(v)
    rows = process_rows(s, v.shape, axis)
    idx = (slice(None),) * axis + (rows,)
    return jax.make_array_from_process_local_data(s, v[idx], v.shape)

  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(functools.partial(one, sharding), batch)
  return jax.tree.map(lambda s, sub: jax.tree.map(functools.partial(one, s), sub), sharding, batch)


def feed(batch: Any, sharding: Any) -> Any:
  """A host batch as the argument of a jitted program that runs on ``sharding``'s devices: when
  that is one device of one process, the host arrays themselves (the program's call transfers
  them, ~6x cheaper than a ``jax.device_put`` of many small arrays: 0.4 against 2.3 ms for 64
  arrays on a CPU); else `shard_global_batch`. ``sharding`` as there (one, or a tree of them)."""
  if jax.process_count() == 1 and all(len(s.device_set) == 1 for s in jax.tree.leaves(
      sharding, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))):
    return jax.tree.map(np.asarray, batch)
  return shard_global_batch(batch, sharding)


def replicate_to_hosts(tree: Any) -> Any:
  """Every leaf as a full NumPy copy on every process (an all-gather across hosts when needed).
  In a single process: one batched ``jax.device_get`` of the tree (its transfers start together)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return process_allgather(x, tiled=True)
    return np.asarray(x)

  return jax.tree.map(one, tree)


def _identity(x: Any) -> Any:
  return x


def _gather_leaf(x: Any, tiled: bool) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not tiled:
      raise ValueError("process_allgather of a global (not fully addressable) array needs "
                       "tiled=True")
    if isinstance(x.sharding, NamedSharding):  # its own mesh: the device order jit requires
      replicated = x.sharding.update(spec=PartitionSpec())
    else:  # the same devices in the same order
      order = np.asarray(x.sharding._device_assignment)  # pylint: disable=protected-access
      replicated = NamedSharding(Mesh(order, ("all",)), PartitionSpec())
    out = jax.jit(_identity, out_shardings=replicated)(x)
  else:
    host = np.asarray(x)
    if host.ndim == 0 or not tiled:
      host = host[None]
    grid = np.asarray(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(grid, ("processes", "local_devices"))
    shape = (host.shape[0] * jax.process_count(),) + host.shape[1:]
    arr = jax.make_array_from_single_device_arrays(
        shape, NamedSharding(mesh, PartitionSpec("processes")),
        [jax.device_put(host, d) for d in jax.local_devices()])
    out = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(arr)
  # Every local device runs its own share of the all-gather (one communicator per device index
  # across processes). Reading one shard waits for that device only: a process that then exits
  # can leave a peer's device thread waiting to connect forever, and the peer hangs in its
  # teardown (seen under load in the 2-process `launch/multihost.py --check`).
  out.block_until_ready()
  return np.asarray(out.addressable_data(0))


def process_allgather(tree: Any, tiled: bool = False) -> Any:
  """Every process's leaves, gathered (collective: every process must call it).

  As `jax.experimental.multihost_utils.process_allgather` (host arrays: stacked ``[P, ...]``, or
  concatenated with ``tiled``; global arrays: their full value), but it returns only once every
  local device has finished its part of the collective.
  """
  if jax.process_count() == 1:
    return jax.tree.map(lambda x: np.asarray(x) if tiled else np.asarray(x)[None], tree)
  return jax.tree.map(lambda x: _gather_leaf(x, tiled), tree)


def sync_global(name: str) -> None:
  """A barrier across all processes (no-op in a single process); ``name`` must agree."""
  if jax.process_count() > 1:
    mine = np.uint32(zlib.crc32(name.encode()))
    names = process_allgather(np.array([mine], np.uint32), tiled=True)
    if not np.all(names == mine):
      raise RuntimeError(f"sync_global({name!r}): the processes reached different barriers "
                         f"(name hashes {names.tolist()})")


def any_process(flag: bool) -> bool:
  """Whether ``flag`` is true on any process (collective: every process must call it)."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(process_allgather(np.array([int(flag)], np.int32)).any())


def host_leaders() -> list[int]:
  """Process indices of the host leaders, ascending (collective: every process must call it)."""
  if jax.process_count() == 1:
    return [0]
  flags = process_allgather(np.array([int(is_host_leader())], np.int32))
  flags = flags.reshape(jax.process_count())  # [num_processes, 1] -> [num_processes]
  return [int(i) for i in np.nonzero(flags)[0]]


def leader_slice(num_items: int, leaders: list[int], process_index: int | None = None) -> slice:
  """The contiguous share of ``num_items`` (prompts) that ``process_index``'s generation process
  handles: `np.array_split` over the leaders in order; an empty slice for non-leaders."""
  process_index = jax.process_index() if process_index is None else process_index
  if process_index not in leaders:
    return slice(0, 0)
  r = leaders.index(process_index)
  bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(num_items), len(leaders))])
  return slice(int(bounds[r]), int(bounds[r + 1]))


def to_global(batch: Any, sharding: NamedSharding, axis: int = 0) -> Any:
  """`shard_global_batch` across processes; the batch itself (NumPy) in a single process."""
  if jax.process_count() == 1:
    return batch
  return shard_global_batch(batch, sharding, axis)

