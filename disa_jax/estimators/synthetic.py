"""A tabular Stage 1 problem with an exact partition function, for offline studies and tests.

Each prompt q has a D-dimensional embedding e_q and K possible outputs. The reference policy is
pi_ref(.|q) = softmax(e_q W_ref + b) over the K outputs, outputs ``0 .. n_correct-1`` have reward 1, and the proposal is

    p_T(.|q) = (1 - mix) * pi_ref-tilted(beta_T) + mix * uniform,

a stronger-than-reference sampler that over-weights correct outputs (full support through the uniform
part, so the IS identity of Prop. 1 holds). Then

    Z(q) = sum_o pi_ref(o|q) exp(beta * r(q, o)) = 1 + (e^beta - 1) * P_ref(correct | q),

is exact and varies smoothly with e_q, which gives Stage 2 something to learn.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class TabularProblem:
  """Arrays of the problem (P prompts, K outputs, D embedding dims)."""

  embeddings: np.ndarray  # [P, D]
  logp_ref: np.ndarray  # [P, K] log pi_ref
  logp_proposal: np.ndarray  # [P, K] log p_T
  reward: np.ndarray  # [P, K] in {0, 1}
  beta: float

  @property
  def log_z(self) -> np.ndarray:
    """``[P]`` exact log Z(q) for the raw reward."""
    return np.asarray(jax.nn.logsumexp(self.logp_ref + self.beta * self.reward, axis=-1))

  def sample(self, key: jax.Array, n: int) -> dict[str, np.ndarray]:
    """Draws n outputs per prompt from p_T.

    Returns:
      dict of ``[P, n]`` arrays: ``output`` (index in [0, K)), ``logp_ref``, ``logp_proposal``, ``reward``.
    """
    idx = np.asarray(jax.random.categorical(key, jnp.asarray(self.logp_proposal), axis=-1,
                                            shape=(n, self.logp_proposal.shape[0]))).T  # [n, P] -> [P, n]
    take = lambda a: np.take_along_axis(a, idx, axis=1)
    return {"output": idx, "logp_ref": take(self.logp_ref), "logp_proposal": take(self.logp_proposal),
            "reward": take(self.reward)}


def make_tabular_problem(seed: int = 0,
                         *,
                         prompts: int = 1000,
                         outputs: int = 64,
                         dim: int = 16,
                         n_correct: int = 6,
                         beta: float = 3.0,
                         proposal_beta: float = 2.0,
                         proposal_mix: float = 0.2,
                         ref_scale: float = 1.5) -> TabularProblem:
  """Builds a `TabularProblem`.

  Args:
    seed: numpy seed.
    prompts, outputs, dim: P, K, D.
    n_correct: correct outputs per prompt (chosen at random per prompt).
    beta: the target's inverse temperature.
    proposal_beta: tilt of the proposal towards correct outputs (beta_T).
    proposal_mix: weight of the uniform component of the proposal, in (0, 1].
    ref_scale: scale of the reference logits (larger = peakier pi_ref).
  """
  if not 0 < proposal_mix <= 1:
    raise ValueError(f"proposal_mix must be in (0, 1], got {proposal_mix}")
  if not 1 <= n_correct < outputs:
    raise ValueError(f"n_correct must be in [1, outputs={outputs}), got {n_correct}")
  rng = np.random.default_rng(seed)
  emb = rng.normal(size=(prompts, dim)).astype(np.float32)
  w_ref = rng.normal(scale=ref_scale / np.sqrt(dim), size=(dim, outputs))
  logits = emb @ w_ref  # [P, K]
  # Outputs 0 .. n_correct-1 are the correct ones for every prompt (output indices are arbitrary labels),
  # so P_ref(correct | q) and log Z(q) are smooth functions of e_q that Stage 2 can learn.
  reward = np.zeros((prompts, outputs), np.float32)
  reward[:, :n_correct] = 1.0
  logp_ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  tilted = logp_ref + proposal_beta * reward
  tilted = np.exp(tilted - tilted.max(-1, keepdims=True))
  prop = (1 - proposal_mix) * tilted / tilted.sum(-1, keepdims=True) + proposal_mix / outputs
  return TabularProblem(embeddings=emb, logp_ref=logp_ref.astype(np.float32),
                        logp_proposal=np.log(prop).astype(np.float32), reward=reward, beta=float(beta))
