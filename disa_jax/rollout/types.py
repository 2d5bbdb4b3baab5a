"""Rollout data types: sampling parameters, completions, the `Engine` protocol and engine names.

Every rollout engine (the JAX sampler, vLLM, and the proxy that runs either of them in a separate
generation process) takes token-id prompts and a `SamplingParams`, and returns one `Completion` per
sample. Importance weights (Stage 1) and the policy ratios (Stage 3) need the log-probability of
each generated token under the distribution that was *actually sampled from*, so `Completion.logprobs`
is the processed distribution (after temperature, top-k and top-p); the raw-model log-probs
(temperature 1, no truncation) are returned on request.

``ENGINES`` names every engine kind, ``MODEL_ENGINES`` those that load a local checkpoint;
`check_kind` and `check_scalar_mapping` check engine options (`disa_jax.rollout.engines`,
`disa_jax.rollout.process`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

FINISH_REASONS = ("stop", "length")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How to sample completions.

  Attributes:
    n: number of samples per prompt (>= 1).
    temperature: softmax temperature; 0 means greedy decoding.
    top_p: nucleus truncation in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    max_tokens: maximum number of generated tokens per sample (>= 1).
    stop_token_ids: generation of a sample stops after it emits one of these ids (the stop token is
      included in the completion). No other token (not even the tokenizer's EOS) stops generation.
    seed: random seed; the same prompts, parameters and seed give the same samples.
    return_raw_logprobs: also return the log-probs of the generated tokens under the raw model.
    prompt_index_offset: seeding only: prompt p of this call draws the samples that prompt
      p + offset of a larger call with the same seed would, so a batch split across hosts (each
      generating its own slice) samples what one engine given the whole batch would.
  """

  n: int = 1
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()
  seed: int = 0
  return_raw_logprobs: bool = False
  prompt_index_offset: int = 0

  JSON_STRICT = True  # (`codec`: unknown keys are refused)

  def __post_init__(self):
    if not isinstance(self.n, int) or self.n < 1:
      raise ValueError(f"SamplingParams.n must be an int >= 1, got {self.n!r}")
    if not (self.temperature >= 0.0):
      raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
    if not (0.0 < self.top_p <= 1.0):
      raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k must be an int >= 0, got {self.top_k!r}")
    if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
      raise ValueError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
    ids = tuple(int(t) for t in self.stop_token_ids)
    if any(t < 0 for t in ids):
      raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
    object.__setattr__(self, "stop_token_ids", ids)
    if not isinstance(self.seed, int):
      raise ValueError(f"SamplingParams.seed must be an int, got {self.seed!r}")
    if not isinstance(self.prompt_index_offset, int) or self.prompt_index_offset < 0:
      raise ValueError(f"SamplingParams.prompt_index_offset must be an int >= 0, got "
                       f"{self.prompt_index_offset!r}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0



@dataclasses.dataclass
class Completion:
  """One sampled continuation of a prompt.

  Attributes:
    token_ids: `[L]` int32 generated ids; includes the stop token when `finish_reason == 'stop'`.
    logprobs: `[L]` float32 log-prob of each token under the distribution actually sampled from
      (after temperature / top-k / top-p); 0.0 for greedy decoding.
    raw_logprobs: `[L]` float32 log-probs under the raw model (temperature 1, no truncation), or None
      when not requested.
    finish_reason: 'stop' (a stop token was emitted) or 'length' (max_tokens reached).
  """

  token_ids: np.ndarray
  logprobs: np.ndarray
  raw_logprobs: np.ndarray | None
  finish_reason: str

  def __post_init__(self):
    self.token_ids = np.asarray(self.token_ids, np.int32)
    self.logprobs = np.asarray(self.logprobs, np.float32)
    if self.raw_logprobs is not None:
      self.raw_logprobs = np.asarray(self.raw_logprobs, np.float32)
    if self.token_ids.ndim != 1 or self.logprobs.shape != self.token_ids.shape:
      raise ValueError(f"Completion.token_ids {self.token_ids.shape} and logprobs "
                       f"{self.logprobs.shape} must be equal-length vectors")
    if self.raw_logprobs is not None and self.raw_logprobs.shape != self.token_ids.shape:
      raise ValueError(f"Completion.raw_logprobs {self.raw_logprobs.shape} must match token_ids "
                       f"{self.token_ids.shape}")
    if self.finish_reason not in FINISH_REASONS:
      raise ValueError(f"Completion.finish_reason must be one of {FINISH_REASONS}, "
                       f"got {self.finish_reason!r}")


@runtime_checkable
class Engine(Protocol):
  """A rollout engine; see the module docstring."""

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """Samples `params.n` completions per prompt; returns `[P][n]` completions."""
    ...

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    """Replaces the model weights in place (HF parameter names and HF layouts)."""
    ...

  def close(self) -> None:
    """Releases the engine's resources; idempotent."""
    ...


def validate_prompts(prompt_token_ids: Sequence[Sequence[int]],
                     vocab_size: int | None = None) -> list[np.ndarray]:
  """Checks and converts prompts to a list of `[T_i]` int32 arrays (every prompt non-empty)."""
  out = []
  for i, p in enumerate(prompt_token_ids):
    a = np.asarray(p, dtype=np.int64)
    if a.ndim != 1 or a.size == 0:
      raise ValueError(f"prompt_token_ids[{i}] must be a non-empty 1-D sequence of ints, "
                       f"got shape {a.shape}")
    if a.min() < 0 or (vocab_size is not None and a.max() >= vocab_size):
      raise ValueError(f"prompt_token_ids[{i}] has ids outside [0, {vocab_size}): "
                       f"min {a.min()}, max {a.max()}")
    out.append(a.astype(np.int32))
  return out


# ----------------------------------------------------------------------------------------------
# Engine names and option checks (shared by `engines` and the generation process).
# ----------------------------------------------------------------------------------------------

ENGINES = ("jax", "vllm", "openai")
MODEL_ENGINES = ("jax", "vllm")  # load a local checkpoint (in this or a generation process)
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
