"""Rollout engines (JAX sampler, vLLM, a served model) and the generation process that hosts them.

`make_engine(kind, model_path, options=..., process=...)` returns an `Engine`; by default the
engine runs in a spawned generation process driven through shared memory (`RemoteEngine`);
`EngineConfig` is the engine section of every command's config (kind 'openai': `OpenAIEngine` over
a `ServedEndpoint`); `stop_ids.stop_token_ids` gives every stage its stop ids. Entry scripts that create a
separate-process engine need an `if __name__ == '__main__':` guard (the process is spawned).
"""

from __future__ import annotations

from disa_jax.rollout.engines import EngineConfig, make_engine
from disa_jax.rollout.openai_engine import ServedEndpoint
from disa_jax.rollout.process import (GenerationProcessError, GenerationProcessHung, ProcessOptions,
                                      RemoteEngine, make_local_engine)
from disa_jax.rollout.types import ENGINES, MODEL_ENGINES, Completion, Engine, SamplingParams

__all__ = ["Completion", "ENGINES", "Engine", "EngineConfig", "GenerationProcessError",
           "GenerationProcessHung", "MODEL_ENGINES", "ProcessOptions", "RemoteEngine",
           "SamplingParams", "ServedEndpoint", "make_engine", "make_local_engine"]
