"""Stage 1 collection: sample from the proposal, grade, score under pi_ref, write labelled records.

For each batch of prompts not yet in the dataset (resume), the proposal engine draws N samples with
the log-probs of the distribution it actually sampled from (processed: after temperature / top-p; or
raw, recorded either way), the verifier grades them, pi_ref scores them teacher-forced, and
`build_records` turns them into labels log Z_IS (eq. 8) and diagnostics, written durably.

Batches are fixed slices of the whole prompt list (``prompts_per_batch`` each), whatever is already
written: engines seed each sample from its batch (its position in the call, and the
generation-process adapter mixes the batch's prompts into the seed), so a rerun must hand the engine
the very batches an uninterrupted run did. A batch that a killed run wrote only in part (the last
line of a jsonl file cut by the kill) is therefore generated, graded and scored whole again, and only
its missing records are written: the resumed dataset equals the uninterrupted one, prompt by prompt.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np
from tqdm import tqdm

from disa_jax import preemption
from disa_jax.estimators.dataset import Stage1Writer, build_records
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.rewards.graded import Response, RewardFn
from disa_jax.rollout.types import Engine, SamplingParams
from disa_jax.scoring.batched import SequenceScorer


@dataclasses.dataclass(frozen=True)
class Stage1Prompt:
  """One prompt to label: its id, text, token ids and whatever the verifier needs (``meta``)."""

  prompt_id: str
  text: str
  token_ids: tuple[int, ...]
  meta: Any = None


def collect_stage1(*,
                   engine: Engine,
                   ref_scorer: SequenceScorer,
                   prompts: Sequence[Stage1Prompt],
                   reward_fn: RewardFn,
                   decode: Callable[[Sequence[int]], str],
                   sampling: SamplingParams,
                   beta: float,
                   reward_transform: RewardTransform,
                   writer: Stage1Writer,
                   label_scale: str = "sum",
                   proposal_logprobs: str = "processed",
                   prompts_per_batch: int = 16,
                   progress: bool = True) -> dict[str, float]:
  """Runs Stage 1 for every prompt not already in ``writer``.

  Args:
    engine: the proposal's rollout engine (any `Engine`; typically in its own process).
    ref_scorer: scores responses under pi_ref.
    prompts: the offline prompt set D_Z.
    reward_fn: the verifier, a `RewardFn` (``(responses, metas) -> Graded``); each prompt's
      ``meta`` is its samples' meta. Grading errors are recorded per sample (``grade_error``).
    decode: token ids -> text (special tokens skipped), the ``text`` of each sample.
    sampling: the proposal's sampling parameters (``n`` = N samples per prompt).
    beta, reward_transform, label_scale: as in `build_records`.
    proposal_logprobs: 'processed' uses `Completion.logprobs`, 'raw' uses `Completion.raw_logprobs`
      (``sampling.return_raw_logprobs`` must then be set).
    writer: the resumable dataset writer.
    prompts_per_batch: prompts per engine call and per durable write.
    progress: show a progress bar.

  Returns:
    dict with ``prompts_done`` (written now), ``prompts_skipped`` (already in ``writer``),
    ``prompts_regenerated`` (already written, sampled again to keep a partly written batch whole),
    ``samples`` (written now), ``seconds``, ``samples_per_s``, ``preempted`` (a SIGTERM / SIGUSR1
    stopped the run after its last written batch, `disa_jax.preemption`; a rerun resumes). No
    prompts (or none left) is a no-op: nothing is generated or written and the counts are 0.
  """
  if proposal_logprobs == "raw" and not sampling.return_raw_logprobs:
    raise ValueError("proposal_logprobs='raw' needs SamplingParams(return_raw_logprobs=True)")
  if proposal_logprobs not in ("processed", "raw"):
    raise ValueError(f"proposal_logprobs must be 'processed' or 'raw', got {proposal_logprobs!r}")
  ids = [p.prompt_id for p in prompts]
  if len(set(ids)) != len(ids):
    raise ValueError("prompt ids must be unique")
  if sampling.n < 1:
    raise ValueError(f"sampling.n must be >= 1, got {sampling.n}")
  done = writer.completed_ids()
  todo = {p.prompt_id for p in prompts if p.prompt_id not in done}
  batches = [b for b in (prompts[i:i + prompts_per_batch]
                         for i in range(0, len(prompts), prompts_per_batch))
             if any(p.prompt_id in todo for p in b)]
  t0, n_samples, regenerated, written, preempted = time.time(), 0, 0, 0, False
  bar = tqdm(total=len(todo), desc="stage 1", unit="prompt", disable=not progress)
  for batch in batches:
    if preemption.agreed():  # every written batch is durable: stop between batches
      preempted = True
      break
    recs = _label_batch(batch, engine=engine, ref_scorer=ref_scorer, reward_fn=reward_fn,
                        decode=decode, sampling=sampling, beta=beta,
                        reward_transform=reward_transform, label_scale=label_scale,
                        proposal_logprobs=proposal_logprobs)
    new = [r for r in recs if r["prompt_id"] in todo]
    writer.write(new)
    written += len(new)
    regenerated += len(recs) - len(new)
    n_samples += sum(len(r["samples"]) for r in new)
    bar.update(len(new))
    bar.set_postfix(samples_per_s=f"{n_samples / max(time.time() - t0, 1e-9):.1f}")
  bar.close()
  secs = time.time() - t0
  return {"prompts_done": written, "prompts_skipped": len(prompts) - len(todo),
          "prompts_regenerated": regenerated, "samples": n_samples, "seconds": secs,
          "samples_per_s": n_samples / secs if secs > 0 else 0.0, "preempted": preempted}


def _label_batch(batch: Sequence[Stage1Prompt], *, engine: Engine, ref_scorer: SequenceScorer,
                 reward_fn: RewardFn, decode: Callable[[Sequence[int]], str],
                 sampling: SamplingParams, beta: float, reward_transform: RewardTransform,
                 label_scale: str, proposal_logprobs: str) -> list[dict[str, Any]]:
  """Samples, grades and scores one batch of prompts; returns its Stage 1 records (unwritten)."""
  comps = engine.generate([list(p.token_ids) for p in batch], sampling)  # [P][N]
  flat_p = [p for p, cs in zip(batch, comps) for _ in cs]
  flat_c = [c for cs in comps for c in cs]
  texts = [decode(c.token_ids.tolist()) for c in flat_c]
  graded = reward_fn([Response(t, tuple(int(x) for x in c.token_ids), c.finish_reason)
                      for t, c in zip(texts, flat_c)], [p.meta for p in flat_p])
  if graded.reward.shape != (len(flat_c),):
    raise ValueError(f"reward_fn returned shape {graded.reward.shape}, expected ({len(flat_c)},)")
  rewards = graded.reward.astype(np.float64)
  logp_ref = ref_scorer.sequence_logprobs([list(p.token_ids) for p in flat_p],
                                          [c.token_ids.tolist() for c in flat_c])
  samples, k = [], 0
  for cs in comps:
    row = []
    for c in cs:
      lp = c.logprobs if proposal_logprobs == "processed" else c.raw_logprobs
      row.append({"token_ids": c.token_ids.tolist(), "text": texts[k], "logp_ref": float(logp_ref[k]),
                  "logp_proposal": float(np.sum(lp, dtype=np.float64)), "reward": float(rewards[k]),
                  "num_tokens": max(int(c.token_ids.size), 1), "grade_error": bool(graded.error[k])})
      k += 1
    samples.append(row)
  return build_records([p.prompt_id for p in batch], [p.text for p in batch], samples, beta=beta,
                       reward_transform=reward_transform, label_scale=label_scale,
                       proposal_logprobs=proposal_logprobs)
