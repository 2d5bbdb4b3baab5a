"""An `Engine` over an OpenAI-compatible completions endpoint that returns per-token log-probs.

The served model (e.g. the 235B proposal behind ``vllm serve``, started once and shared by many
jobs) is reached through the maintained `openai` client (timeouts, transport retries, connection
pooling). Each sample is one ``/completions`` request whose ``prompt`` is the prompt's token ids,
with the per-sample seed the offline vLLM engine uses (`vllm_engine.derive_seed`), the stop ids
and ``ignore_eos`` (only ``stop_token_ids`` end a sample, as in the other engines), ``logprobs=0``
and vLLM's ``return_token_ids``, so token ids come back without a tokenizer on this side. Requests
run concurrently (``max_concurrency``).

Log-probs. vLLM's server reports, for each sampled token, the log-prob under the distribution set
by its ``--logprobs-mode``: the default is the raw model (temperature 1, no truncation); Stage 1's
importance weights need the distribution actually sampled from. `OpenAIEngine` checks this once at
start-up (one token sampled at temperature 2, then scored by the raw model through
``prompt_logprobs``: equal numbers mean a raw-mode server) and refuses a raw-mode server with the
flag to add: ``--logprobs-mode processed_logprobs``. Raw log-probs, when asked for, come from a
teacher-forced ``prompt_logprobs`` request over prompt + completion, as in `VllmEngine.score`.

`ServedEndpoint` is the engine's config section (``EngineConfig.openai``). A server that cannot be
reached or fails (after the client's retries) raises `ServedEngineError` naming the URL and the
request; the weights of a served model cannot be replaced
(`update_weights` raises), so this engine serves Stage 1 proposal sampling and evaluation, not the
Stage 3 policy.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.rollout.types import Completion, SamplingParams, validate_prompts
from disa_jax.rollout.vllm_engine import derive_seed

# The log-prob check: one token at this temperature must not score like the raw model.
_CHECK_TEMPERATURE = 2.0
_CHECK_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True, kw_only=True)
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


class ServedEngineError(RuntimeError):
  """The OpenAI-compatible server was unreachable, failed a request, or is misconfigured."""


def openai_client(base_url: str, api_key: str, *, timeout_s: float, max_retries: int,
                  on_request=None):
  """An `openai.OpenAI` client; ``on_request(request)`` is called for every HTTP request sent.

  ``api_key`` '' means ``$OPENAI_API_KEY`` where set (so a key need not be written into a config).
  """
  import httpx  # pylint: disable=g-import-not-at-top  (comes with openai, an optional extra)
  import openai  # pylint: disable=g-import-not-at-top  (optional: the 'openai' extra)
  hooks = {"request": [on_request]} if on_request is not None else {}
  api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # vLLM takes any without --api-key
  return openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s,
                       max_retries=max_retries,
                       http_client=httpx.Client(event_hooks=hooks, timeout=timeout_s))


class OpenAIEngine:
  """`Engine` over a served model; see the module docstring.

  Args:
    endpoint: the server (`ServedEndpoint`).
    check_logprobs: refuse a server that reports raw instead of sampled-distribution log-probs.
  """

  def __init__(self, endpoint: ServedEndpoint, *, check_logprobs: bool = True):
    endpoint.check()
    import openai  # pylint: disable=g-import-not-at-top  (optional: the 'openai' extra)
    self._openai = openai
    self.endpoint = endpoint
    self.client = openai_client(endpoint.base_url, endpoint.api_key, timeout_s=endpoint.timeout_s,
                                max_retries=endpoint.max_retries)
    self._pool = concurrent.futures.ThreadPoolExecutor(endpoint.max_concurrency,
                                                       thread_name_prefix="disa-openai")
    self._closed = False
    if check_logprobs:
      self.check_logprobs_mode()

  def _request(self, what: str, **kwargs) -> Any:
    """One ``/completions`` request; returns its first choice (`ServedEngineError` on failure)."""
    if self._closed:
      raise ServedEngineError("OpenAIEngine is closed")
    try:
      reply = self.client.completions.create(model=self.endpoint.model, **kwargs)
    except self._openai.APIError as e:
      raise ServedEngineError(f"served model {self.endpoint.model!r} at {self.endpoint.base_url} "
                              f"failed {what} (after {self.endpoint.max_retries} retries): "
                              f"{type(e).__name__}: {e}") from e
    return reply.choices[0]

  def _sample(self, prompt: np.ndarray, params: SamplingParams, seed: int
              ) -> tuple[np.ndarray, np.ndarray, str]:
    c = self._request(
        "a sampling request", prompt=prompt.tolist(), max_tokens=params.max_tokens,
        temperature=params.temperature, top_p=params.top_p, seed=seed, logprobs=0,
        frequency_penalty=0.0, presence_penalty=0.0,
        extra_body={"top_k": params.top_k, "min_p": 0.0, "repetition_penalty": 1.0,
                    "stop_token_ids": list(params.stop_token_ids), "ignore_eos": True,
                    "return_token_ids": True, "skip_special_tokens": False})
    ids = np.asarray(getattr(c, "token_ids", None) or [], np.int32)
    lps = (c.logprobs.token_logprobs if c.logprobs is not None else None) or []
    if len(lps) != len(ids):
      raise ServedEngineError(f"server at {self.endpoint.base_url} returned {len(ids)} token ids "
                              f"and {len(lps)} log-probs; it must be vLLM's OpenAI server "
                              f"(return_token_ids, logprobs)")
    lp = np.zeros(len(ids), np.float32) if params.greedy else np.asarray(lps, np.float32)
    reason = "stop" if c.finish_reason == "stop" else "length"
    if reason == "stop" and (len(ids) == 0 or int(ids[-1]) not in params.stop_token_ids):
      raise ServedEngineError(f"server at {self.endpoint.base_url} stopped (stop_reason "
                              f"{getattr(c, 'stop_reason', None)!r}) on a token that is not one of "
                              f"stop_token_ids {params.stop_token_ids}")
    return ids, lp, reason

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """See `Engine.generate`; returns `[P][n]` completions."""
    prompts = validate_prompts(prompt_token_ids)
    jobs = [(p, derive_seed(params.seed, p + params.prompt_index_offset, j))
            for p in range(len(prompts)) for j in range(params.n)]
    flat = list(self._pool.map(lambda job: self._sample(prompts[job[0]], params, job[1]), jobs))
    raw = (self.score([prompts[p] for p, _ in jobs], [f[0] for f in flat])
           if params.return_raw_logprobs else None)
    comps = [Completion(token_ids=ids, logprobs=lp, raw_logprobs=None if raw is None else raw[i],
                        finish_reason=reason) for i, (ids, lp, reason) in enumerate(flat)]
    return [comps[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

  def _score_one(self, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
    if not len(completion):
      return np.zeros(0, np.float32)
    c = self._request("a scoring request",
                      prompt=np.concatenate([prompt, completion]).tolist(), max_tokens=1,
                      temperature=0.0, extra_body={"prompt_logprobs": 0, "ignore_eos": True})
    steps = (getattr(c, "prompt_logprobs", None) or [])[len(prompt):]
    if len(steps) != len(completion):
      raise ServedEngineError(f"server at {self.endpoint.base_url} returned no prompt_logprobs "
                              f"for {len(completion)} tokens")
    return np.array([s[str(int(t))]["logprob"] for s, t in zip(steps, completion)], np.float32)

  def score(self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
            ) -> list[np.ndarray]:
    """Raw-model log-probs of `completions[i]` given `prompts[i]` (teacher forced), `[L_i]` each."""
    return list(self._pool.map(self._score_one, prompts, completions))

  def check_logprobs_mode(self) -> None:
    """Refuses a server that reports raw-model log-probs for sampled tokens (see module doc)."""
    prompt = np.zeros(1, np.int32)
    params = SamplingParams(temperature=_CHECK_TEMPERATURE, max_tokens=1)
    ids, lp, _ = self._sample(prompt, params, seed=0)
    raw = self._score_one(prompt, ids)
    if abs(float(lp[0]) - float(raw[0])) < _CHECK_TOLERANCE:
      raise ServedEngineError(
          f"server at {self.endpoint.base_url} reports raw-model log-probs for sampled tokens "
          f"(token {int(ids[0])} at temperature {_CHECK_TEMPERATURE}: {float(lp[0]):.5f}, raw "
          f"{float(raw[0]):.5f}); start it with `--logprobs-mode processed_logprobs` so that "
          f"log-probs are those of the distribution sampled from")

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    raise ServedEngineError(f"the weights of the served model {self.endpoint.model!r} at "
                            f"{self.endpoint.base_url} cannot be replaced: engine.kind='openai' "
                            f"serves Stage 1 proposals and evaluation, not a Stage 3 policy")

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._pool.shutdown(wait=True)
    self.client.close()

  def __enter__(self) -> "OpenAIEngine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
