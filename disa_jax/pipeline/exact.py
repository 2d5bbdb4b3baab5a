"""Ground truth on the sum task: exact log Z, the tilted target over correct answers, and KL to it.

The output space is every generation of at most ``max_tokens`` tokens (a generation cut at the length
limit is one outcome, with its prefix probability), the same for pi_ref, pi_theta and the target
pi~ = pi_ref exp(beta r) / Z. All correct answers are short, so

- log Z(q) is exact from the n + 1 correct completions scored under pi_ref (`exact_log_z`);
- the target restricted to correct answers is pi_ref renormalised over them, and its entropy, and the
  policy's, are exact from scoring the same n + 1 completions under pi_theta;
- KL(pi_theta || pi~) = E_{o ~ pi_theta}[log pi_theta(o) - log pi_ref(o) - beta r(o)] + log Z(q) is
  estimated without bias from samples of pi_theta (their raw log-probs from the engine, log pi_ref
  by teacher forcing), with the exact log Z.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from disa_jax.rewards.sum_task import SumTask, exact_log_z
from disa_jax.rollout.types import Completion
from disa_jax.scoring.batched import SequenceScorer


@dataclasses.dataclass
class CorrectSetScores:
  """Per prompt, log-probs of its n + 1 correct completions (a = 0..n) under one model."""

  ns: list[int]
  logp: list[np.ndarray]  # each [n + 1]

  def p_correct(self) -> np.ndarray:
    """``[P]`` total probability of a correct answer."""
    return np.asarray([np.exp(lp).sum() for lp in self.logp])

  def normalized(self) -> list[np.ndarray]:
    """The model's distribution restricted to the correct answers, per prompt."""
    out = []
    for lp in self.logp:
      q = np.exp(lp - lp.max())
      out.append(q / q.sum())
    return out

  def entropy(self) -> np.ndarray:
    """``[P]`` entropy (nats) of the restricted distribution."""
    return np.asarray([-(q * np.log(np.maximum(q, 1e-300))).sum() for q in self.normalized()])


def score_correct_set(task: SumTask, tokenizer, scorer: SequenceScorer, prompt_ids: dict[int, list[int]],
                      ns: Sequence[int]) -> CorrectSetScores:
  """Scores every correct completion of every prompt n in ``ns`` under the scorer's model."""
  prompts, resp, owner = [], [], []
  for n in ns:
    for c in task.correct_completions(tokenizer, n):
      prompts.append(prompt_ids[n])
      resp.append(c)
      owner.append(n)
  lp = scorer.sequence_logprobs(prompts, resp)
  owner = np.asarray(owner)
  return CorrectSetScores(list(ns), [lp[owner == n] for n in ns])


def log_z_from_reference(ref_scores: CorrectSetScores, beta: float) -> np.ndarray:
  """``[P]`` exact log Z(q) (binary reward, raw transform)."""
  return exact_log_z(ref_scores.logp, beta)


def kl_to_target_mc(completions: Sequence[Sequence[Completion]], rewards: np.ndarray,
                    logp_ref: np.ndarray, log_z: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
  """Unbiased Monte Carlo KL(pi_theta || pi~) per prompt, from samples of pi_theta at temperature 1.

  Args:
    completions: ``[P][k]`` samples with ``raw_logprobs`` (log pi_theta of each token).
    rewards: ``[P, k]`` rewards of those samples.
    logp_ref: ``[P, k]`` log pi_ref of those samples (sequence sums).
    log_z: ``[P]`` exact log Z.
    beta: inverse temperature.

  Returns:
    (``[P]`` KL estimates, ``[P]`` their standard errors).
  """
  lp_theta = np.asarray([[float(np.sum(c.raw_logprobs, dtype=np.float64)) if c.raw_logprobs is not None
                          else np.nan for c in cs] for cs in completions])
  if np.isnan(lp_theta).any():
    raise ValueError("kl_to_target_mc needs completions sampled with return_raw_logprobs=True")
  terms = lp_theta - logp_ref - beta * rewards + log_z[:, None]  # [P, k]
  k = terms.shape[1]
  return terms.mean(1), terms.std(1, ddof=1) / np.sqrt(k) if k > 1 else np.full(terms.shape[0], np.nan)
