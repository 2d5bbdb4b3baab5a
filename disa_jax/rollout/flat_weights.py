"""Flat weight push: the policy's parameters as a few contiguous buffers, one copy each way.

A `FlatLayout` places the parameters of a `Transformer` (its own layouts: stacked `[L, ...]` layer
arrays, `[in, out...]` kernels) one after the other, each cast to the push dtype, flattened and
starting at a multiple of `ALIGN` elements, in buckets of at most ``bucket_bytes`` (0: one buffer).
The layout is a function of the model config, the dtype and the bucket size alone, so both ends of
a push compute it.

* `export` (trainer, collective): one jitted cast + concatenate per bucket on the device (with a
  mesh, the bucket comes out replicated: the all-gather runs on the devices, and every host holds
  the whole model), then one device -> host copy of each bucket, on host leaders only (``fetch``);
  the next bucket is computed while one is copied, so the export's extra device memory is about two
  buckets. ``assemble='host'`` builds the same bytes on the host instead: each parameter cast on
  its device, then copied into its place in a host bucket. On the CPU backend, where the devices'
  memory is host memory and XLA's concatenate of casts runs at ~0.2 GB/s on 2 cores, this is the
  faster way ('auto' picks it there, for parameters this process holds whole).
* `FlatWeights`: the host buckets plus their layout. It is a read-only Mapping of the Hugging Face
  names to HF-layout *views* of the buckets (the linear kernels as transposed views), so every
  engine's ``update_weights`` takes it; the generation process (`process.RemoteEngine`) copies the
  buckets into shared memory with several threads and rebuilds a `FlatWeights` on the shared views
  in the child; vLLM loads the HF-named views (`vllm_engine`).
* `load` (the JAX sampler): one host -> device copy per bucket and one jitted split straight into
  the engine's own parameters (the same layouts: no transposes; a cast only when the engine's
  dtype differs from the push's).
* `copy_into` (a JAX sampler in the trainer's own process, one process): no host at all, one jitted
  cast and copy of every parameter into the engine's placement; the values `export` + `load` give.
  On the default job's CPU runs the flat push took 3.7 ms a step (81 s of its 1,648 s of run time).

Bit-exact: the cast is XLA's round-to-nearest-even (as NumPy's and ml_dtypes'), and a push in the
engine's dtype copies bits.

Not done: a GPU-to-GPU path (NCCL or CUDA IPC from the trainer's devices to the generation
process's) does not exist: every push goes device -> host memory (pageable, or page-locked with
``host_memory='pinned'``) -> shared memory -> device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from disa_jax import config as config_lib
from disa_jax import models
from disa_jax.models.config import ModelConfig
from disa_jax.models.hf_interop import np_dtype as _np_dtype
from disa_jax.models.transformer import layer_param_specs

ALIGN = 64  # elements: every parameter starts at a multiple of this within its bucket
DEFAULT_BUCKET_BYTES = 1 << 30


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dict -> {'a.b': leaf}."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
  """{'a.b': leaf} -> nested dict."""
  out: dict[str, Any] = {}
  for path, v in flat.items():
    *parents, last = path.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[last] = v
  return out


def model_params(model: models.Transformer) -> dict[str, jax.Array]:
  """``{'embed': ..., 'layers.q_kernel': ..., ...}``: the model's parameters by path."""
  return _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def param_shapes(config: ModelConfig) -> tuple[tuple[str, tuple[int, ...]], ...]:
  """The parameters of a `Transformer` of ``config`` as (path, shape), sorted by path. Plain
  Python (no JAX backend starts: vLLM's generation process calls it too)."""
  v, d = config.vocab_size, config.hidden_size
  shapes = {"embed": (v, d), "final_norm": (d,)}
  if not config.tie_word_embeddings:
    shapes["lm_head"] = (d, v)
  for name, (shape, _) in layer_param_specs(config).items():
    shapes[f"layers.{name}"] = (config.num_layers,) + tuple(shape)
  return tuple(sorted(shapes.items()))


@dataclasses.dataclass(frozen=True)
class Entry:
  """One parameter in a flat layout: ``size`` elements from ``offset`` of bucket ``bucket``."""
  path: str
  shape: tuple[int, ...]
  bucket: int
  offset: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each parameter of a model of ``config`` lies in the push's buckets (module docstring).

  Attributes:
    config: the model's architecture.
    dtype: the pushed dtype's name ('bfloat16', 'float32', ...).
    bucket_bytes: a bucket holds at most this many bytes, unless one parameter alone is larger
      (it then fills a bucket by itself); 0 = one bucket.
  """
  config: ModelConfig
  dtype: str
  bucket_bytes: int = DEFAULT_BUCKET_BYTES

  def __post_init__(self):
    object.__setattr__(self, "dtype", _np_dtype(self.dtype).name)
    if not jnp.issubdtype(self.dtype, jnp.floating):
      raise ValueError(f"FlatLayout.dtype must be a float dtype, got {self.dtype!r}")
    config_lib.check_count(self.bucket_bytes, "FlatLayout.bucket_bytes", "0 = one bucket")

  @functools.cached_property
  def _plan(self) -> tuple[tuple[Entry, ...], tuple[int, ...]]:
    cap = self.bucket_bytes // _np_dtype(self.dtype).itemsize if self.bucket_bytes else math.inf
    entries, sizes, bucket, at = [], [], 0, 0
    for path, shape in param_shapes(self.config):
      size = math.prod(shape)
      if at and at + size > cap:
        sizes.append(at)
        bucket, at = bucket + 1, 0
      entries.append(Entry(path, shape, bucket, at))
      at = -(-(at + size) // ALIGN) * ALIGN
    sizes.append(at)
    return tuple(entries), tuple(sizes)

  @property
  def entries(self) -> tuple[Entry, ...]:
    return self._plan[0]

  @property
  def bucket_sizes(self) -> tuple[int, ...]:
    """Elements of each bucket (alignment padding included)."""
    return self._plan[1]

  def bucket_entries(self, bucket: int) -> tuple[Entry, ...]:
    return tuple(e for e in self.entries if e.bucket == bucket)

  @property
  def nbytes(self) -> int:
    return sum(self.bucket_sizes) * _np_dtype(self.dtype).itemsize

  def check_params(self, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Raises ValueError naming the first parameter of ``shapes`` (path -> shape) that is missing
    from this layout, absent from ``shapes`` or of another shape."""
    want = {e.path: tuple(e.shape) for e in self.entries}
    got = {path: tuple(shape) for path, shape in shapes.items()}
    path = first_mismatch(got, want)
    if path is not None:
      raise ValueError(f"{where}: parameter {path!r} has shape {got.get(path)} but the pushed "
                       f"layout has {want.get(path)} (None = absent)")


def first_mismatch(a: Mapping[str, tuple[int, ...]], b: Mapping[str, tuple[int, ...]]
                   ) -> str | None:
  """The first path (sorted) that one of two {path: shape} maps lacks or shapes otherwise; None
  when they agree."""
  return next((p for p in sorted(set(a) | set(b)) if a.get(p) != b.get(p)), None)


def _hf_view(rule: models.KeyRule, ours: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
  """Our (per-layer) layout -> the HF layout, as a view (a transposed one for linear kernels)."""
  if rule.transpose:
    return ours.reshape(hf_shape[::-1]).T  # [in, out...] -> [out, in]
  return ours.reshape(hf_shape)


class FlatWeights(Mapping):
  """Host buckets of a push and their layout; a read-only Mapping of HF names to HF-layout views.

  Args:
    layout: the buckets' layout.
    buffers: one 1-D array per bucket, of the layout's dtype and size (owned arrays, or views of
      the generation process's shared memory).
  """

  def __init__(self, layout: FlatLayout, buffers: Sequence[np.ndarray]):
    if len(buffers) != len(layout.bucket_sizes):
      raise ValueError(f"FlatWeights: {len(buffers)} buffers for a layout of "
                       f"{len(layout.bucket_sizes)} buckets")
    dtype = _np_dtype(layout.dtype)
    for i, (buf, size) in enumerate(zip(buffers, layout.bucket_sizes)):
      if buf.dtype != dtype or buf.shape != (size,):
        raise ValueError(f"FlatWeights: bucket {i} is {buf.dtype}{list(buf.shape)}, the layout "
                         f"needs {dtype}[{size}]")
    self.layout = layout
    self.buffers = list(buffers)
    self._entries = {e.path: e for e in layout.entries}
    self._hf = models.expected_hf_keys(layout.config)  # name -> (rule, layer or None)
    self.timings: dict[str, float] = {}  # filled by `export`

  @property
  def nbytes(self) -> int:
    return sum(b.nbytes for b in self.buffers)

  def param(self, path: str) -> np.ndarray:
    """Parameter ``path`` in our layout, a view of its bucket."""
    e = self._entries[path]
    return self.buffers[e.bucket][e.offset:e.offset + e.size].reshape(e.shape)

  def __getitem__(self, name: str) -> np.ndarray:
    if name not in self._hf:
      raise KeyError(name)
    rule, layer = self._hf[name]
    ours = self.param(rule.path)
    return _hf_view(rule, ours if layer is None else ours[layer], rule.hf_shape(self.layout.config))

  def __iter__(self) -> Iterator[str]:
    return iter(self._hf)

  def __len__(self) -> int:
    return len(self._hf)


def _replicated(x: jax.Array) -> NamedSharding | None:
  """x's mesh, every device holding the whole array (None: x is not on a named mesh)."""
  sharding = getattr(x, "sharding", None)
  return sharding.update(spec=PartitionSpec()) if isinstance(sharding, NamedSharding) else None


@functools.lru_cache(maxsize=32)
def _export_fn(layout: FlatLayout, bucket: int, out_sharding: NamedSharding | None):
  """Jitted: bucket ``bucket``'s parameters (a list, in entry order) -> the 1-D bucket."""
  entries, size = layout.bucket_entries(bucket), layout.bucket_sizes[bucket]
  dtype = jnp.dtype(layout.dtype)

  def fn(arrays: list[jax.Array]) -> jax.Array:
    parts, at = [], 0
    for e, x in zip(entries, arrays):
      if e.offset > at:
        parts.append(jnp.zeros((e.offset - at,), dtype))
      parts.append(x.astype(dtype).reshape(-1))
      at = e.offset + e.size
    if size > at:
      parts.append(jnp.zeros((size - at,), dtype))
    return jnp.concatenate(parts)

  return jax.jit(fn, out_shardings=out_sharding)


ASSEMBLE = ("auto", "device", "host")
HOST_MEMORY = ("auto", "pageable", "pinned")


def _assemble_on_host(params: Mapping[str, jax.Array], assemble: str) -> bool:
  if assemble not in ASSEMBLE:
    raise ValueError(f"flat export assemble must be one of {ASSEMBLE}, got {assemble!r}")
  whole = all(x.is_fully_addressable for x in params.values())
  if assemble == "host" and not whole:
    raise ValueError("flat export assemble='host' needs parameters this process holds whole; "
                     "these are sharded across processes (use 'device')")
  if assemble == "auto":
    return whole and all(d.platform == "cpu" for x in params.values() for d in x.devices())
  return assemble == "host"


def _host_bucket(layout: FlatLayout, bucket: int, params: Mapping[str, jax.Array]) -> np.ndarray:
  """Bucket ``bucket`` assembled on the host: each parameter cast on its device, then copied into
  its place; the gaps are zeros, as the device path writes them."""
  dtype = jnp.dtype(layout.dtype)
  buf = np.zeros((layout.bucket_sizes[bucket],), _np_dtype(layout.dtype))
  for e in layout.bucket_entries(bucket):
    buf[e.offset:e.offset + e.size] = np.asarray(params[e.path].astype(dtype)).reshape(-1)
  return buf


@functools.lru_cache(maxsize=8)
def _layout(config: ModelConfig, dtype: str, bucket_bytes: int) -> FlatLayout:
  """One `FlatLayout` object per model shape, dtype and bucket size, so that its plan is worked
  out once per run, not once per push."""
  return FlatLayout(config, dtype, bucket_bytes)


def export(model: models.Transformer, dtype: Any = None, *,
           bucket_bytes: int = DEFAULT_BUCKET_BYTES, fetch: bool = True,
           assemble: str = "auto", host_memory: str = "auto") -> FlatWeights | None:
  """Collective: the model's parameters as host buckets (see the module docstring).

  Every process of a multi-process run must call it (the buckets are gathered on the devices);
  only those with ``fetch`` copy them to the host.

  Args:
    model: the policy (parameters possibly sharded, across processes too).
    dtype: the pushed dtype (None: the parameters' own).
    bucket_bytes: the layout's bucket size (`FlatLayout`).
    fetch: copy the buckets to this host (False on processes that push nothing).
    assemble: 'device' (one jitted cast + concatenate per bucket, one copy to the host), 'host'
      (the same bytes built on the host, for parameters this process holds whole) or 'auto'
      ('host' on the CPU backend, else 'device').
    host_memory: where the device path's buckets land on the host: 'pageable' (a NumPy copy of
      the device buffer), 'pinned' (first a device -> page-locked host copy, the memory kind
      'pinned_host', which a GPU's copy engine writes at full speed; the array then reads it) or
      'auto' (`resolve_host_memory`: 'pinned' on accelerators that offer it). On an H200, 4B
      parameters (8.04 GB bf16) came to the host in 0.16 s pinned against 5.9 s pageable
      (`benchmarks/results/weight_push_h200.jsonl`).

  Returns:
    The `FlatWeights` (``timings['export_s']``: device cast + device -> host), or None without
    ``fetch``.
  """
  params = model_params(model)
  layout = _layout(model.config, _np_dtype(model.param_dtype if dtype is None else dtype).name,
                   bucket_bytes)
  layout.check_params({p: x.shape for p, x in params.items()}, "flat export")
  if host_memory not in HOST_MEMORY:
    raise ValueError(f"flat export host_memory must be one of {HOST_MEMORY}, got {host_memory!r}")
  if _assemble_on_host(params, assemble):  # nothing collective: each process reads its own copy
    t0 = time.perf_counter()
    if not fetch:
      return None
    flat = FlatWeights(layout, [_host_bucket(layout, b, params)
                                for b in range(len(layout.bucket_sizes))])
    flat.timings["export_s"] = time.perf_counter() - t0
    return flat
  sharding = _replicated(next(iter(params.values())))

  def run(bucket: int) -> jax.Array:
    fn = _export_fn(layout, bucket, sharding)
    return fn([params[e.path] for e in layout.bucket_entries(bucket)])

  t0 = time.perf_counter()
  buffers, pending = [], run(0)
  for bucket in range(len(layout.bucket_sizes)):
    following = run(bucket + 1) if bucket + 1 < len(layout.bucket_sizes) else None
    # Wait for every local device's share of the gather before one process reads its copy
    # (`disa_jax.parallel.distributed.process_allgather`'s note on hangs).
    pending.block_until_ready()
    if fetch:
      buffers.append(_to_host(pending.addressable_data(0), host_memory))
    pending = following
  if not fetch:
    return None
  flat = FlatWeights(layout, buffers)
  flat.timings["export_s"] = time.perf_counter() - t0
  return flat


def resolve_host_memory(device: Any, host_memory: str) -> str:
  """'auto' -> 'pinned' on a device other than a CPU whose memories include 'pinned_host', else
  'pageable' (the CPU's device memory is host memory already); other values unchanged."""
  if host_memory != "auto":
    return host_memory
  kinds = {m.kind for m in device.addressable_memories()}
  return "pinned" if device.platform != "cpu" and "pinned_host" in kinds else "pageable"


def _to_host(shard: jax.Array, host_memory: str) -> np.ndarray:
  """One device buffer as a NumPy array, through page-locked host memory for 'pinned'."""
  if resolve_host_memory(next(iter(shard.devices())), host_memory) == "pinned":
    shard = jax.device_put(shard, shard.sharding.with_memory_kind("pinned_host"))
  return np.asarray(shard)


@functools.lru_cache(maxsize=32)
def _split_fn(layout: FlatLayout, bucket: int, dtypes: tuple[str, ...], out_shardings: Any):
  """Jitted: the 1-D bucket -> its parameters (a list in entry order) in ``dtypes``."""
  entries = layout.bucket_entries(bucket)

  def fn(buf: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.slice(buf, (e.offset,), (e.offset + e.size,)).reshape(e.shape).astype(d)
                 for e, d in zip(entries, dtypes))

  return jax.jit(fn, out_shardings=out_shardings)


def load(current: Mapping[str, jax.Array], flat: FlatWeights) -> dict[str, jax.Array]:
  """The pushed parameters on the device, laid out as ``current`` (the engine's parameters by
  path: their dtypes, shardings and committedness are kept, so nothing that was compiled for the
  old ones compiles again).

  Raises:
    ValueError: naming the first parameter the push and ``current`` disagree on.
  """
  layout = flat.layout
  layout.check_params({p: x.shape for p, x in current.items()}, "flat weights load")
  out = {}
  for bucket, host in enumerate(flat.buffers):
    entries = layout.bucket_entries(bucket)
    first = current[entries[0].path]
    if getattr(first, "committed", True):
      dev = jax.device_put(host, _replicated(first) or first.sharding)
      shardings = tuple(current[e.path].sharding for e in entries)
    else:
      dev, shardings = jax.device_put(host), None
    fn = _split_fn(layout, bucket, tuple(current[e.path].dtype.name for e in entries), shardings)
    out.update(zip((e.path for e in entries), fn(dev)))
    del dev
  return out


def lower_programs(layout: FlatLayout, *, param_dtype: Any, sharding: Any = None
                   ) -> dict[str, list[jax.stages.Lowered]]:
  """The push's jitted programs, one per bucket, lowered on abstract inputs placed by
  ``sharding`` (e.g. on the abstract devices of `disa_jax.parallel.gpu_compile`): 'export' (the
  trainer's cast + concatenate of ``param_dtype`` parameters, `export`) and 'split' (the engine's
  split into ``param_dtype`` parameters, `load`)."""
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  out: dict[str, list[jax.stages.Lowered]] = {"export": [], "split": []}
  for bucket, size in enumerate(layout.bucket_sizes):
    entries = layout.bucket_entries(bucket)
    out["export"].append(_export_fn(layout, bucket, sharding).lower(
        [sds(e.shape, param_dtype) for e in entries]))
    dtypes = (jnp.dtype(param_dtype).name,) * len(entries)
    shardings = None if sharding is None else (sharding,) * len(entries)
    out["split"].append(_split_fn(layout, bucket, dtypes, shardings).lower(
        sds((size,), layout.dtype)))
  return out


@functools.lru_cache(maxsize=32)
def _copy_fn(dtype: str | None, dtypes: tuple[str, ...], shardings: tuple[Any, ...]):
  """Jitted: parameters (a list) -> each cast to ``dtype`` (None: kept), then to its ``dtypes``
  entry, in new buffers placed by ``shardings``."""

  def fn(arrays: list[jax.Array]) -> list[jax.Array]:
    return [(x if dtype is None else x.astype(dtype)).astype(d) for x, d in zip(arrays, dtypes)]

  return jax.jit(fn, out_shardings=list(shardings))


class DeviceCopy:
  """`copy_into` prepared once for a model and a source of the same architecture (paths and shapes
  checked, the model's dtypes and placements read and the jitted copy built here); each call then
  flattens the source's parameters and runs the copy, without walking either model by path again
  (a push of the default job's policy: 2.4 ms before, one walk of each model per call since).

  Args:
    model: the model to load into (its parameters' dtypes and placements are the copy's outputs).
    source: a model of the same parameters (paths and shapes) in this process.
    dtype: the push's dtype (None: the source's own).

  Raises:
    ValueError: naming the first parameter the two models disagree on (path or shape).
  """

  def __init__(self, model: models.Transformer, source: models.Transformer, dtype: Any = None):
    current, src = model_params(model), model_params(source)
    path = first_mismatch({p: x.shape for p, x in src.items()},
                          {p: x.shape for p, x in current.items()})
    if path is not None:
      raise ValueError(f"copy_into: parameter {path!r} is "
                       f"{getattr(src.get(path), 'shape', 'absent')} in the source and "
                       f"{getattr(current.get(path), 'shape', 'absent')} in the model")
    paths = sorted(current)
    src_paths, self.source_def = _leaf_paths(nnx.state(source, nnx.Param))
    model_paths, self.model_def = _leaf_paths(nnx.state(model))
    self._take = [src_paths.index(p) for p in paths]  # source leaf of each copied parameter
    self._put = [model_paths.index(p) for p in paths]  # its leaf in the model's whole state
    self._shardings = [current[p].sharding for p in paths]
    self._fn = _copy_fn(None if dtype is None else _np_dtype(dtype).name,
                        tuple(current[p].dtype.name for p in paths), tuple(self._shardings))

  def __call__(self, source: models.Transformer, state: nnx.State) -> nnx.State:
    """``state`` (the model's whole state, `nnx.state(model)`) with the parameters of ``source``
    copied in: new buffers, not yet waited for. The source must have the structure it had."""
    leaves, tree = jax.tree.flatten(nnx.state(source, nnx.Param))
    if tree != self.source_def:
      raise ValueError("copy_into: the source's parameters changed structure since the copy was "
                       "prepared")
    src = [leaves[i] for i in self._take]
    # Placed first on the model's devices where they are elsewhere (a trainer sharded over several
    # devices of this process (fsdp) and an engine on one); in one batched transfer.
    moved = [k for k, (x, s) in enumerate(zip(src, self._shardings))
             if x.sharding.device_set != s.device_set]
    if moved:
      for k, x in zip(moved, jax.device_put([src[k] for k in moved],
                                            [self._shardings[k] for k in moved])):
        src[k] = x
    out = jax.tree.leaves(state)
    for k, x in zip(self._put, self._fn(src)):
      out[k] = x
    return jax.tree.unflatten(self.model_def, out)


def _leaf_paths(state: nnx.State) -> tuple[list[str], Any]:
  """The dotted path (as `model_params` names it) of each leaf of ``state``, in leaf order, and
  its tree structure."""
  with_paths, tree = jax.tree_util.tree_flatten_with_path(state)
  names = [".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
           for path, _ in with_paths]
  return names, tree


def copy_into(model: models.Transformer, source: models.Transformer, dtype: Any = None) -> None:
  """Loads ``source``'s parameters (a model of the same architecture in this process: the trainer's
  policy) into ``model`` on the devices, with none of a flat push's host copies: each cast to
  ``dtype`` (the push's; None: its own) and then to ``model``'s dtype, in new buffers placed as
  ``model``'s (the trainer may donate its own afterwards). The values are those of `export` +
  `load_into` (round-to-nearest-even both ways). Waits for the copies. (`DeviceCopy` prepares
  this once for repeated pushes.)

  Raises:
    ValueError: naming the first parameter the two models disagree on (path or shape).
  """
  state = DeviceCopy(model, source, dtype)(source, nnx.state(model))
  nnx.update(model, state)
  jax.block_until_ready(state)


def load_into(model: models.Transformer, flat: FlatWeights) -> None:
  """Loads ``flat`` into ``model``'s parameters in place (`load`) and waits for the copies."""
  _set_params(model, load(model_params(model), flat))


def _set_params(model: models.Transformer, new: Mapping[str, jax.Array]) -> None:
  """``model``'s parameters replaced by ``new`` (by path, `model_params`); waits for them."""
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, _nest(new))
  nnx.update(model, state)
  jax.block_until_ready(new)
