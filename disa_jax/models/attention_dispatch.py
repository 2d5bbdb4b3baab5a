"""Which attention implementation runs a packed-row self-attention, and running it on a mesh.

`Transformer.attention_impl` names one of `disa_jax.config.ATTENTION_IMPLS`:

- 'dense': the reference, `attention.gqa_attention` on the whole `[B, T, T]` mask (causal query
  blocks, or ``attention_chunk`` query chunks): what the model ran before the layout-based
  implementations; every other one is tested against it;
- 'xla': block-sparse in plain XLA (`attention_xla`: causal and, with ``max_segment_len``, banded
  key ranges; ``attention_chunk`` checkpoints its blocks); runs everywhere and every layout;
- 'pallas': the Pallas flash-attention kernels (`attention_pallas`: segment-aware block skipping
  at run time); GPU (Triton), or the Pallas interpreter on a CPU (tests; slow); not TPU;
- 'cudnn': cuDNN flash attention on the packed layout (`attention_cudnn`); GPU (Hopper or later),
  bfloat16 / float16;
- 'splash': JAX's splash attention (`attention_splash`); TPU;
- 'auto': on a CPU 'dense' for rows of at most `CPU_DENSE_MAX_ROW` tokens, 'xla' for longer ones;
  'cudnn' on a GPU, 'splash' on a TPU. On a CPU the dense scores of short rows cost less than the
  block loop: a default-job update (rows of 72 tokens, d = 64) 21.6 ms against 32.6 ms, its
  scoring forward 2.3 against 3.2 ms; 25.1 against 26.7 ms at 128 tokens, 45.5 against 53.3 ms at
  256 (`benchmarks/profile_train_step.py --shape default --layout shared --rows 4 --attention`,
  2-core Intel Xeon); beyond, the `[B, N, T, T]` scores grow with T^2.

A fused implementation that cannot express a call (shared-prompt branch ids for cuDNN / splash;
cuDNN's dtypes, head sizes and GPUs before Hopper, e.g. the paper's A100s) runs it on 'xla' instead (`resolve_impl`; a warning is logged
once per reason when the implementation was asked for by name, not by 'auto'); asking for 'cudnn' or
'splash' on another backend is an error. With a mesh (`Transformer.sharding`), the kernels run
per device under `jax.shard_map` over the batch (and head) axes the activations are sharded
over; 'dense' and 'xla' are plain XLA and are partitioned by XLA.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from disa_jax import config as config_lib
from disa_jax.models import attention as A
from disa_jax.models import attention_cudnn
from disa_jax.models import attention_pallas
from disa_jax.models import attention_splash
from disa_jax.models import attention_xla
from disa_jax.parallel.rules import ShardingContext, logical_to_spec

logger = logging.getLogger(__name__)
_AUTO = {"cpu": "xla", "gpu": "cudnn", "tpu": "splash"}
CPU_DENSE_MAX_ROW = 256  # 'auto' on a CPU: 'dense' for rows of at most this many tokens
_BACKENDS = {"cudnn": ("gpu",), "splash": ("tpu",), "pallas": ("gpu", "cpu")}


def resolve_impl(impl: str, *, backend: str, dtype: Any, head_dim: int, branches: bool,
                 capability: str | None = None, row_len: int = 0) -> str:
  """The implementation that runs a call (see the module docstring).

  Args:
    impl: the requested one (`disa_jax.config.ATTENTION_IMPLS`).
    backend: `jax.default_backend()`.
    dtype: the queries' dtype.
    head_dim: H.
    branches: the call has shared-prompt branch ids.
    capability: the GPU's compute capability ('8.0', '9.0'; None = not known).
    row_len: T, the rows' tokens ('auto' on a CPU; 0 = not known: 'xla').

  Raises:
    ValueError: an unknown name, or 'cudnn' / 'splash' / 'pallas' asked for on another backend.
  """
  config_lib.check_attention_impl(impl)
  explicit = impl != "auto"
  if not explicit:
    impl = _AUTO.get(backend, "xla")
    if backend == "cpu" and 0 < row_len <= CPU_DENSE_MAX_ROW:
      impl = "dense"
  elif impl in _BACKENDS and backend not in _BACKENDS[impl]:
    raise ValueError(f"attention_impl={impl!r} runs on {_BACKENDS[impl]} only; this backend is "
                     f"{backend!r} (use 'xla' or 'auto')")
  why = ""
  if impl == "cudnn":
    why = attention_cudnn.unsupported(dtype, head_dim, branches, capability)
  elif impl == "splash" and branches:
    why = "shared-prompt branch masks are not a splash mask"
  if not why:
    return impl
  if explicit:
    _warn_fallback(impl, why)
  return "xla"


@functools.cache
def _warn_fallback(impl: str, why: str) -> None:
  """Logs once per (implementation, reason) that an explicitly asked-for ``impl`` runs on 'xla'."""
  logger.warning("attention_impl=%r cannot run this call (%s); running it on 'xla' instead", impl,
                 why)


def _mesh_specs(sharding: ShardingContext, q: jax.Array, k: jax.Array
                ) -> tuple[PartitionSpec, PartitionSpec]:
  """(q / k / v spec, segment-id spec): the batch over the activations' batch axes, the heads over
  theirs when both N and K divide (else the heads are whole on every device)."""
  size = lambda axes: math.prod(sharding.mesh.shape[a] for a in
                                ((axes,) if isinstance(axes, str) else (axes or ())))
  batch = logical_to_spec(("batch",), sharding.rules)[0]
  heads = logical_to_spec(("act_heads",), sharding.rules)[0]
  if q.shape[0] % size(batch):
    batch = None
  if q.shape[2] % size(heads) or k.shape[2] % size(heads):
    heads = None
  return PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None)


def _per_device(fn, sharding: ShardingContext | None, q, k, v, layout: A.SegmentLayout):
  """``fn(q, k, v, layout)``, under `jax.shard_map` when a mesh of several devices is attached."""
  if sharding is None or sharding.mesh.size == 1:
    return fn(q, k, v, layout)
  qkv, rows = _mesh_specs(sharding, q, k)
  layout_specs = jax.tree.map(lambda _: rows, layout)
  mapped = jax.shard_map(fn, mesh=sharding.mesh, in_specs=(qkv, qkv, qkv, layout_specs),
                         out_specs=qkv, check_vma=False)
  return mapped(q, k, v, layout)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, layout: A.SegmentLayout, *, impl: str,
           chunk: int = 0, window: int = 0, max_segments: int = 0,
           sharding: ShardingContext | None = None) -> jax.Array:
  """Grouped-query self-attention over packed rows by implementation ``impl`` (resolved).

  Args:
    q: `[B, T, N, H]` queries.
    k: `[B, T, K, H]` keys.
    v: `[B, T, K, H]` values.
    layout: the rows' `attention.SegmentLayout`.
    impl: a resolved implementation (`resolve_impl`; not 'auto').
    chunk: ``attention_chunk`` ('dense' and 'xla': checkpointed query blocks of this many rows).
    window: ``max_segment_len`` ('xla': the band; rows with a longer segment get NaN).
    max_segments: the most segments per row ('cudnn': required, >= 1; see `attention_cudnn`).
    sharding: the model's mesh context, if any.

  Returns:
    `[B, T, N, H]` in q's dtype; zero on padding rows.
  """
  if impl == "dense":
    return A.gqa_attention(q, k, v, A.dense_mask(layout), query_chunk=chunk, causal=True)
  if impl == "xla":
    return attention_xla.xla_attention(q, k, v, layout, window=window, chunk=chunk)
  if impl == "pallas":
    fn = attention_pallas.pallas_attention
  elif impl == "cudnn":
    fn = lambda *a: attention_cudnn.cudnn_attention(*a, max_segments=max_segments)
  elif impl == "splash":
    fn = attention_splash.splash_attention
  else:
    raise ValueError(f"attend: impl must be a resolved implementation, got {impl!r}")
  return _per_device(fn, sharding, q, k, v, layout)
