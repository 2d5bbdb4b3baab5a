"""Exact evaluation against the reward-tilted target, for tasks whose correct set can be enumerated.

For a binary reward with the raw transform, the target pi~(o|q) = pi_ref(o|q) exp(beta r(q, o)) / Z(q)
is known exactly once every correct response of q is scored under pi_ref (the task's correct-set
function, `disa_jax.tasks.base.Task.correct_set`; the sum task has one). With P_ref(c) = sum over the correct
set of pi_ref:

    Z(q) = 1 + (e^beta - 1) P_ref(c)              (exact, `exact_log_z`)
    P~(c) = e^beta P_ref(c) / Z(q)                 the target's probability of a correct answer
    pi~(o | correct) = pi_ref(o) / P_ref(c)        the target restricted to the correct set

Scoring the same correct set under the policy gives its P(c) and its distribution over correct
answers exactly, hence the entropy over correct answers and KL(pi|c || pi~|c). The remaining term
of the chain-rule decomposition

    KL(pi || pi~) = KL(P_c || P~_c) + P_c KL(pi|c || pi~|c) + P_w KL(pi|w || pi~|w)

(binary KL of being correct, plus the conditional KLs over correct and over wrong answers, P_w =
1 - P_c) is estimated without bias by Monte Carlo: over all samples (`wrong_term`), drawn from the
policy at temperature 1 (their raw log-probs from the engine, log pi_ref by teacher forcing), or,
with ``wrong_samples`` K > 0, from K samples per prompt of the policy conditioned on a wrong answer
(`disa_jax.eval.wrong_answers`: every sample informs the term, which plain samples leave to the
rare wrong one). The plain Monte Carlo KL over all
samples is reported beside it; both carry standard errors.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import models
from disa_jax.eval import wrong_answers
from disa_jax.rewards.graded import Response, RewardFn
from disa_jax.rollout.types import Completion, SamplingParams
from disa_jax.scoring.batched import SequenceScorer

# ``(tokenizer, reward_meta) -> every correct response (token ids, stop token included)``: a task's
# enumerable correct set (`disa_jax.tasks.base.Task.correct_set`).
CorrectSetFn = Callable[[Any, Mapping[str, Any]], list[list[int]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExactTargetConfig:
  """The exact evaluation of `run_evaluation` (off unless ``reference_path`` is set).

  Attributes:
    reference_path: pi_ref's HF directory ('' = off).
    beta: inverse temperature of the target (raw binary reward).
    kl_samples: policy samples per prompt for the Monte Carlo terms (>= 2).
    seed: their sampling seed; each measurement draws its own samples, seeded by (seed, step)
      (`measurement_seed`), so the measurements of a run are independent.
    packing: the policy / reference scorers pack several sequences per row (`SequenceScorer`);
      False: one padded row each (for comparison).
    attention_chunk: attention query block of the models this section loads (`load_model`; 0 =
      dense, c > 0 = blocks of c queries; `disa_jax.models.Transformer`).
    attention_impl: their attention over packed rows (`disa_jax.config.ATTENTION_IMPLS`).
    heldout_path: Stage 3 only: a prompt file measured beside the run's own prompts at every
      measurement, logged 'exact_heldout/*' ('' = none; the sum job's held-out prompts).
    wrong_samples: the wrong-answer term P_w KL(pi|w || pi~|w) from this many samples per prompt of
      the policy conditioned on a wrong answer (`disa_jax.eval.wrong_answers`, decoded with the
      policy's scorer, seeded by (seed, step) apart from the engine's); 0 = from the
      ``kl_samples`` plain samples (`wrong_term`; the reports measured before it existed).
    share_prompts: the scorers put a prompt's tokens once per packed row for all its sequences
      (`SequenceScorer`): a correct set of n + 1 answers to one prompt costs its answers' tokens
      and one copy of the prompt, not n + 1 copies; the same measures up to float32 rounding.
    wrong_decode: how the conditional wrong samples are decoded (`wrong_answers.sample_wrong`):
      'full' (the reference) runs the whole buffer for every token, 'cached' the prompts once
      and then one token per row through a KV cache (the same distributions up to float32
      rounding).
    scorer_rows: packed rows per forward pass of the tracker's scorers (`SequenceScorer`
      ``batch_size``). The same measures up to float32 rounding (a row's log-probs change in their
      last bits with the pass's row count); on a CPU, passes of 8 rows take a measurement of the
      default job's policies from 0.19 to 0.08 s, where 64 rows are mostly empty
      (benchmarks/results/exact_tracker_rows_cpu.json).
  """
  reference_path: str = ""
  beta: float = 15.0
  kl_samples: int = 64
  seed: int = 8
  packing: bool = True
  attention_chunk: int = 0
  attention_impl: str = "auto"
  heldout_path: str = ""
  wrong_samples: int = codec.field(default=0, omit=0)  # recorded only where set (config.to_dict)
  share_prompts: bool = codec.field(default=False, omit=False)  # (likewise)
  wrong_decode: str = codec.field(default="full", omit="full")  # (likewise)
  scorer_rows: int = codec.field(default=64, omit=64)  # (likewise)

  def __post_init__(self):
    config_lib.check_attention_chunk(self.attention_chunk, "exact_target.attention_chunk")
    config_lib.check_attention_impl(self.attention_impl, "exact_target.attention_impl")
    if not self.beta > 0:
      raise ValueError(f"exact_target.beta must be > 0, got {self.beta!r}")
    if self.kl_samples < 2:
      raise ValueError(f"exact_target.kl_samples must be >= 2, got {self.kl_samples!r}")
    if not (isinstance(self.wrong_samples, int) and (self.wrong_samples == 0
                                                     or self.wrong_samples >= 2)):
      raise ValueError(f"exact_target.wrong_samples must be 0 (off) or an int >= 2, got "
                       f"{self.wrong_samples!r}")
    if self.wrong_decode not in wrong_answers.DECODES:
      raise ValueError(f"exact_target.wrong_decode must be one of {wrong_answers.DECODES}, got "
                       f"{self.wrong_decode!r}")
    if not (isinstance(self.scorer_rows, int) and self.scorer_rows >= 1):
      raise ValueError(f"exact_target.scorer_rows must be an int >= 1, got {self.scorer_rows!r}")
    if self.heldout_path and not self.reference_path:
      raise ValueError(f"exact_target.heldout_path={self.heldout_path!r} needs "
                       "exact_target.reference_path (the measures are off without it)")

  @property
  def enabled(self) -> bool:
    return bool(self.reference_path)

  def load_model(self, path: str) -> Any:
    """The model of the local HF directory ``path`` (float32, unsharded) with this attention."""
    return models.from_pretrained(path, attention_chunk=self.attention_chunk,
                                  attention_impl=self.attention_impl)

  def scorer(self, model: Any, pad_id: int) -> Any:
    """The `SequenceScorer` of these measures (``scorer_rows`` rows per pass; packed rows grow with
    the data)."""
    return SequenceScorer(model, pad_id=pad_id, batch_size=self.scorer_rows, pad_to=16,
                          packing=self.packing, share_prompts=self.share_prompts)


def exact_log_z(log_p_correct_ref: np.ndarray, beta: float) -> np.ndarray:
  """``[P]`` log Z = log(1 + (e^beta - 1) P_ref(c)) from ``[P]`` log P_ref(c) (binary raw reward)."""
  log_em1 = beta + np.log(-np.expm1(-beta))  # log(e^beta - 1), stable
  return np.logaddexp(0.0, log_em1 + np.asarray(log_p_correct_ref, np.float64))


def _logsumexp(x: np.ndarray) -> float:
  m = float(np.max(x))
  return m + float(np.log(np.sum(np.exp(x - m))))


def _mean_se(x: np.ndarray) -> tuple[float, float]:
  x = np.asarray(x, np.float64)
  if x.size == 0:
    return float("nan"), float("nan")
  return float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size)) if x.size > 1 else float("nan")


@dataclasses.dataclass(frozen=True)
class CorrectSetTerms:
  """The exact terms of one prompt (`correct_set_terms`); every field is a scalar ``[]`` of that
  prompt, from its ``[C]`` correct responses scored under the policy and pi_ref.

  Attributes:
    log_z: log Z(q) (`exact_log_z`).
    p_correct: P(c), the policy's probability of a correct answer.
    p_correct_ref: P_ref(c), pi_ref's.
    p_correct_target: P~(c) = e^beta P_ref(c) / Z(q), the target's.
    entropy_correct: the policy's entropy over the correct answers (of pi|c).
    target_entropy_correct: the target's (of pi~|c).
    kl_correct: KL(pi|c || pi~|c).
    kl_binary: KL(P_c || P~_c), the binary KL of being correct.
  """
  log_z: float
  p_correct: float
  p_correct_ref: float
  p_correct_target: float
  entropy_correct: float
  target_entropy_correct: float
  kl_correct: float
  kl_binary: float


def correct_set_terms(logp_policy: np.ndarray, logp_ref: np.ndarray, beta: float
                      ) -> CorrectSetTerms:
  """The exact terms of one prompt from its correct set scored under both models.

  Args:
    logp_policy, logp_ref: ``[C]`` trajectory log-probs of the C correct responses.
    beta: inverse temperature.

  Returns:
    `CorrectSetTerms` of the prompt.
  """
  lp, lr = np.asarray(logp_policy, np.float64), np.asarray(logp_ref, np.float64)
  if lp.shape != lr.shape or lp.ndim != 1 or lp.size == 0:
    raise ValueError(f"correct_set_terms needs two [C] log-prob arrays (C >= 1), got "
                     f"logp_policy {lp.shape} and logp_ref {lr.shape}")
  lpc, lrc = _logsumexp(lp), _logsumexp(lr)  # log P(c), log P_ref(c)
  log_z = float(exact_log_z(lrc, beta))
  q, t = np.exp(lp - lpc), np.exp(lr - lrc)  # pi|c and pi~|c
  pc, ptc = float(np.exp(lpc)), float(np.exp(beta + lrc - log_z))
  kl_bin = 0.0
  for a, b in ((pc, ptc), (1.0 - pc, 1.0 - ptc)):
    if a > 0:
      kl_bin += a * (np.log(a) - np.log(max(b, 1e-300)))
  return CorrectSetTerms(
      log_z=log_z, p_correct=pc, p_correct_ref=float(np.exp(lrc)), p_correct_target=ptc,
      entropy_correct=float(-(q * np.log(np.maximum(q, 1e-300))).sum()),
      target_entropy_correct=float(-(t * np.log(np.maximum(t, 1e-300))).sum()),
      kl_correct=float((q * (lp - lpc - (lr - lrc))).sum()), kl_binary=float(kl_bin))


@dataclasses.dataclass(frozen=True, eq=False)
class ExactTarget:
  """The exact reward-tilted target of a prompt set (`correct_set_terms` under pi_ref), persisted
  as one JSON file (the main job's ``exact.json``).

  Attributes:
    prompt_ids: ``[P]`` the prompts, in the order of the arrays.
    log_z: ``[P]`` the exact log Z(q) (`exact_log_z`).
    target_entropy_correct: ``[P]`` the target's entropy over the correct answers.
    p_correct_ref: ``[P]`` P_ref(c), pi_ref's probability of a correct answer.
    beta: the inverse temperature of the target.
  """
  prompt_ids: tuple[str, ...]
  log_z: np.ndarray = codec.field(size_of="prompt_ids")
  target_entropy_correct: np.ndarray = codec.field(size_of="prompt_ids")
  p_correct_ref: np.ndarray = codec.field(size_of="prompt_ids")
  beta: float

  ARRAYS = ("log_z", "target_entropy_correct", "p_correct_ref")

  def __post_init__(self):
    for name in self.ARRAYS:
      arr = np.asarray(getattr(self, name), np.float64)
      if arr.shape != (len(self.prompt_ids),):
        raise ValueError(f"ExactTarget.{name} must have shape [P] = ({len(self.prompt_ids)},), "
                         f"got {arr.shape}")
      object.__setattr__(self, name, arr)
    object.__setattr__(self, "prompt_ids", tuple(self.prompt_ids))

  __eq__ = artifacts.fields_equal

  @classmethod
  def from_logprobs(cls, logprobs: Mapping[str, np.ndarray], beta: float) -> "ExactTarget":
    """From ``{prompt id: [C] log pi_ref of its correct answers}`` (the target of pi_ref)."""
    terms = [correct_set_terms(lp, lp, beta) for lp in logprobs.values()]
    return cls(tuple(logprobs), *(np.asarray([getattr(t, k) for t in terms]) for k in cls.ARRAYS),
               beta=float(beta))

  def log_z_by_id(self) -> dict[str, float]:
    return dict(zip(self.prompt_ids, self.log_z.tolist()))

  def log_z_of(self, prompt_ids: Sequence[str]) -> np.ndarray:
    """``[len(prompt_ids)]`` the exact log Z of ``prompt_ids`` (KeyError naming a missing one)."""
    by_id = self.log_z_by_id()
    missing = [p for p in prompt_ids if p not in by_id]
    if missing:
      raise KeyError(f"the exact target has no log Z for prompts {missing[:5]}")
    return np.asarray([by_id[p] for p in prompt_ids], np.float64)



MEASURES = ("p_correct", "p_correct_target", "entropy_correct", "target_entropy_correct",
            "kl_binary", "kl_correct", "kl_decomposed", "kl_mc", "log_z", "tb_sq",
            "p_wrong_kl_wrong", "kl_mc_se", "p_wrong_kl_wrong_se", "kl_decomposed_se", "kl_wrong",
            "p_correct_kl_correct")


@dataclasses.dataclass(frozen=True, eq=False)
class ExactMeasures:
  """The exact measures of a policy on P prompts (`ExactTracker.measure`, as an evaluation stores
  them under ``exact`` in its ``<benchmark>.json``).

  Attributes:
    means: every measure of `MEASURES`, averaged over the prompts (``*_se``: the standard errors of
      the Monte Carlo means).
    samples_per_prompt: k, the policy samples per prompt of the Monte Carlo terms.
    wrong_samples_per_prompt: K, the samples of pi|w per prompt of the wrong-answer term (0: that
      term from the k plain samples; `ExactTargetConfig.wrong_samples`).
    per_prompt: ``[P]`` each prompt's measures (`correct_set_terms` and `monte_carlo_terms`).
  """
  per_prompt: tuple[Mapping[str, float], ...]
  samples_per_prompt: int
  means: Mapping[str, float] = codec.field(inline=True, keys=MEASURES)
  wrong_samples_per_prompt: int = codec.field(default=0, omit=0)

  def __post_init__(self):
    missing = [k for k in MEASURES if k not in self.means]
    if missing:
      raise ValueError(f"ExactMeasures.means lacks measures {missing} (it needs every one of "
                       f"MEASURES)")
    object.__setattr__(self, "per_prompt", tuple(self.per_prompt))

  __eq__ = artifacts.fields_equal

  def __getitem__(self, name: str) -> float:
    """The mean of measure ``name`` (KeyError for one that is not in `MEASURES`)."""
    return self.means[name]

  def per_prompt_values(self, name: str) -> np.ndarray:
    """``[P]`` measure ``name`` of every prompt."""
    return np.asarray([p[name] for p in self.per_prompt], np.float64)

  def to_json(self, per_prompt: bool = True) -> dict[str, Any]:
    """The stored form (`ExactTracker.measure`'s keys; ``per_prompt=False`` leaves it out)."""
    return codec.encode(self, omit=() if per_prompt else ("per_prompt",))


def wrong_term(lp_policy: np.ndarray, lp_ref: np.ndarray, reward: np.ndarray, p_correct: float,
               p_correct_ref: float) -> tuple[float, float]:
  """Unbiased Monte Carlo estimate of P_w KL(pi|w || pi~|w) from k policy samples, and its SE.

  With pi|w = pi / P_w and pi~|w = pi_ref / P_ref(w) on the wrong answers (P_w = 1 - P_c and
  P_ref(w) = 1 - P_ref(c) exact, from the correct set):

      P_w KL(pi|w || pi~|w) = sum_{o wrong} pi(o) [log pi(o) - log pi_ref(o)] + P_w log(P_ref(w)/P_w)
                            = E_pi[1{o wrong} (log pi(o) - log pi_ref(o))] + P_w log(P_ref(w)/P_w).

  The expectation is over *all* policy samples (a correct sample contributes 0), so its sample mean
  is unbiased whether or not a wrong answer was drawn; no conditioning on the wrong samples and no
  zero fill (which keeps only 1 - P_c^k of the term in expectation).

  Args:
    lp_policy, lp_ref: ``[k]`` trajectory log-probs of k policy samples (temperature 1).
    reward: ``[k]`` their binary rewards.
    p_correct, p_correct_ref: the exact P_c under the policy and under pi_ref.

  Returns:
    (estimate, standard error over the k samples; NaN for k = 1).
  """
  pw, pw_ref = 1.0 - p_correct, 1.0 - p_correct_ref
  wrong = np.asarray(reward) < 0.5
  if wrong.any() and not pw_ref > 0:
    raise ValueError(f"a wrong sample was drawn but P_ref(wrong) = {pw_ref!r}: pi~ gives it no "
                     "mass")
  x = np.where(wrong, np.asarray(lp_policy, np.float64) - np.asarray(lp_ref, np.float64), 0.0)
  mean, se = _mean_se(x)
  exact = pw * (np.log(pw_ref) - np.log(pw)) if pw > 0 else 0.0
  return mean + float(exact), se


def monte_carlo_terms(lp_policy: np.ndarray, lp_ref: np.ndarray, reward: np.ndarray,
                      exact: CorrectSetTerms, beta: float) -> dict[str, float]:
  """The sampled terms of one prompt: the MC KL and the wrong-answer term of the decomposition.

  Args:
    lp_policy, lp_ref: ``[k]`` trajectory log-probs of k policy samples (temperature 1).
    reward: ``[k]`` their binary rewards.
    exact: `correct_set_terms` of the prompt.
    beta: inverse temperature.

  Returns:
    ``kl_mc`` / ``kl_mc_se`` (all samples), ``p_wrong_kl_wrong`` / ``p_wrong_kl_wrong_se``
    (`wrong_term`, unbiased), ``kl_wrong`` (KL(pi|w || pi~|w) from the wrong samples alone, a
    diagnostic; NaN without any), ``wrong_samples``, and ``tb_sq``: the mean squared TB residual
    with the exact log Z, the on-policy L_TB(theta; Z) of Prop. 4 (the terms of the KL are the
    residuals).
  """
  terms = lp_policy - lp_ref - beta * reward + exact.log_z  # [k] residuals R = log pi / pi~
  kl, kl_se = _mean_se(terms)
  wrong = reward < 0.5
  # pi|w = pi / P_w and pi~|w = pi_ref|w = pi_ref / P_ref(w), with P_ref(w) = 1 - P_ref(c).
  pw, pw_ref = 1.0 - exact.p_correct, 1.0 - exact.p_correct_ref
  cond = (lp_policy[wrong] - np.log(max(pw, 1e-300))) - (lp_ref[wrong] - np.log(max(pw_ref,
                                                                                    1e-300)))
  pwkw, pwkw_se = wrong_term(lp_policy, lp_ref, reward, exact.p_correct, exact.p_correct_ref)
  return {"kl_mc": kl, "kl_mc_se": kl_se, "kl_wrong": _mean_se(cond)[0],
          "p_wrong_kl_wrong": pwkw, "p_wrong_kl_wrong_se": pwkw_se,
          "wrong_samples": int(wrong.sum()), "tb_sq": float(np.mean(terms ** 2))}


WRONG_STREAM = 1  # the conditional wrong samples' generator: (seed, step, WRONG_STREAM)


def measurement_seed(seed: int, step: int) -> int:
  """The sampling seed of the measurement at ``step``: a hash of (seed, step), distinct per step and
  unrelated to the training rollouts' seeds (a plain seed + step could coincide with one)."""
  if step < 0:
    raise ValueError(f"measurement step must be >= 0, got {step!r}")
  return int(np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0] >> 1)


class ExactTracker:
  """The exact measures of a policy on a fixed set of prompts (`run_evaluation`, and Stage 3 every
  ``validation.every`` steps), built by a task's measurement hook (`disa_jax.tasks.base.Task.measures`).

  The correct sets and their log pi_ref are computed once; each `measure` scores the correct sets
  under the current policy and draws ``cfg.kl_samples`` samples per prompt from the engine serving
  it (temperature 1, raw log-probs) for the Monte Carlo terms.

  Args:
    cfg: `ExactTargetConfig` (beta, kl_samples, seed).
    tokenizer: the shared tokenizer (decodes samples for the reward, builds the correct sets).
    prompts: ``[P]`` prompt token ids.
    metas: ``[P]`` reward metas (the correct-set function reads them).
    correct_set: the task's `CorrectSetFn`, ``(tokenizer, meta) -> [C_p] correct responses``.
    reward_fn: the task's `RewardFn` (grades the policy samples).
    ref_scorer: a `SequenceScorer` of pi_ref.
    max_tokens: the response limit that defines the output space (a generation cut there is one
      outcome), the same as the policy's sampling.
  """

  def __init__(self, cfg: ExactTargetConfig, tokenizer: Any, prompts: Sequence[Sequence[int]],
               metas: Sequence[Mapping[str, Any]], correct_set: CorrectSetFn, reward_fn: RewardFn,
               ref_scorer: Any, max_tokens: int):
    if len(prompts) != len(metas) or not prompts:
      raise ValueError(f"ExactTracker needs one meta per prompt and at least one prompt, got "
                       f"{len(prompts)} prompts and {len(metas)} metas")
    self.cfg, self.tokenizer, self.ref_scorer = cfg, tokenizer, ref_scorer
    self.prompts, self.metas = [list(p) for p in prompts], list(metas)
    self.reward_fn = reward_fn
    sets = [correct_set(tokenizer, m) for m in self.metas]  # [P][C_p]
    empty = [i for i, cs in enumerate(sets) if not cs]
    if empty:
      raise ValueError(f"the correct set of prompts {empty[:5]} is empty (metas[{empty[0]}] = "
                       f"{self.metas[empty[0]]!r})")
    self._flat_p = [p for p, cs in zip(self.prompts, sets) for _ in cs]
    self._flat_c = [c for cs in sets for c in cs]
    self._bounds = np.cumsum([0] + [len(cs) for cs in sets])
    self._lp_ref = ref_scorer.sequence_logprobs(self._flat_p, self._flat_c)
    # Built once, for every measurement: each prompt's correct-answer prefixes (the conditional
    # wrong-answer sampler's), and the correct sets packed for the policy's scorer (`measure`).
    b = self._bounds
    self._tries = [wrong_answers.PrefixTrie(self._flat_c[i:j]) for i, j in zip(b[:-1], b[1:])] \
        if cfg.wrong_samples else []
    self._correct_packed = None
    longest = max(len(c) for c in self._flat_c)
    if longest > max_tokens:
      raise ValueError(f"max_tokens={max_tokens} cannot hold a correct answer of {longest} tokens")
    self.max_tokens = max_tokens

  def measure(self, engine: Any, policy_scorer: Any, *, step: int) -> ExactMeasures:
    """Every exact measure of the policy served by ``engine`` and scored by ``policy_scorer``.

    ``step`` (the RL step, 0 for a final evaluation) selects the samples' seed
    (`measurement_seed`): two measurements of a run never share their samples.

    Returns:
      `ExactMeasures`: the means over prompts of every measure of `MEASURES` (with ``*_se`` for the
      Monte Carlo terms), k, and the ``[P]`` per-prompt measures.
    """
    # per token: the conditional sampler's P(correct | prefix) needs them
    self._correct_packed = policy_scorer.pack(self._flat_p, self._flat_c,
                                              reuse=self._correct_packed)
    tok_lp = policy_scorer.token_logprobs_packed(self._correct_packed)
    lp_pol = np.asarray([float(np.sum(x, dtype=np.float64)) for x in tok_lp])
    b = self._bounds
    exact = [correct_set_terms(lp_pol[i:j], self._lp_ref[i:j], self.cfg.beta)
             for i, j in zip(b[:-1], b[1:])]
    comps = engine.generate(self.prompts, SamplingParams(
        n=self.cfg.kl_samples, temperature=1.0, max_tokens=self.max_tokens,
        stop_token_ids=(int(self.tokenizer.eos_token_id),), seed=measurement_seed(self.cfg.seed, step),
        return_raw_logprobs=True))
    wrong = (self._conditional_wrong(exact, tok_lp, policy_scorer, step)
             if self.cfg.wrong_samples else None)
    return _combine(exact, comps, self.prompts, self.metas, self.ref_scorer, self.tokenizer,
                    self.reward_fn, self.cfg.beta, wrong=wrong, wrong_k=self.cfg.wrong_samples)

  def _conditional_wrong(self, exact: Sequence[CorrectSetTerms], tok_lp: Sequence[np.ndarray],
                         policy_scorer: Any, step: int) -> list[tuple[float, float, float]]:
    """``[P]`` (P_w KL(pi|w || pi~|w), its SE, KL(pi|w || pi~|w)) from ``wrong_samples`` draws of
    pi|w per prompt (`disa_jax.eval.wrong_answers`); a draw the task's grader accepts is an error
    (the correct set would miss it)."""
    b, k = self._bounds, self.cfg.wrong_samples
    prefixes = [wrong_answers.CorrectPrefixes(self._flat_c[i:j], tok_lp[i:j], trie=trie)
                for i, j, trie in zip(b[:-1], b[1:], self._tries)]
    drawn, lp_pol = wrong_answers.sample_wrong(
        policy_scorer, self.prompts, prefixes, k, max_tokens=self.max_tokens,
        stop_ids=(int(self.tokenizer.eos_token_id),), pad_id=policy_scorer.pad_id,
        rng=np.random.default_rng([int(self.cfg.seed), int(step), WRONG_STREAM]),
        decode=self.cfg.wrong_decode)
    flat = [o for os in drawn for o in os]
    flat_p = [p for p in self.prompts for _ in range(k)]
    eos = self.tokenizer.eos_token_id
    reward = _grade(self.reward_fn, self.tokenizer, flat,
                    ["stop" if o[-1] == eos else "length" for o in flat], self.metas, k)
    if (reward >= 0.5).any():
      r = int(np.flatnonzero(reward >= 0.5)[0])
      raise ValueError(f"a response drawn as wrong, "
                       f"{self.tokenizer.decode(flat[r], skip_special_tokens=True)!r} (tokens "
                       f"{flat[r]}) of prompt {r // k} (meta {self.metas[r // k]!r}), is graded "
                       "correct: the task's correct set misses an answer its grader accepts")
    lp_ref = self.ref_scorer.sequence_logprobs(flat_p, flat).reshape(len(self.prompts), k)
    return [wrong_answers.conditional_wrong_term(lp_pol[i], lp_ref[i], e.p_correct,
                                                 e.p_correct_ref) for i, e in enumerate(exact)]


def _grade(reward_fn: RewardFn, tokenizer, responses: Sequence[Sequence[int]],
           finish_reasons: Sequence[str], metas: Sequence[Mapping[str, Any]], k: int) -> np.ndarray:
  """``[P * k]`` rewards of ``k`` responses per prompt (token ids, decoded for the grader)."""
  return reward_fn([Response(tokenizer.decode(o, skip_special_tokens=True),
                             tuple(int(t) for t in o), f)
                    for o, f in zip(responses, finish_reasons)],
                   [m for m in metas for _ in range(k)]).reward


def _combine(exact: Sequence[CorrectSetTerms], comps: Sequence[Sequence[Completion]], prompts,
             metas, ref_scorer, tokenizer, reward_fn: RewardFn, beta: float,
             wrong: Sequence[tuple[float, float, float]] | None = None, wrong_k: int = 0
             ) -> ExactMeasures:
  """Adds the Monte Carlo terms to the exact ones and averages over prompts (the wrong-answer term
  from ``wrong``, `ExactTracker._conditional_wrong`'s, where given)."""
  k = len(comps[0])
  flat = [c for cs in comps for c in cs]
  reward = _grade(reward_fn, tokenizer, [c.token_ids for c in flat],
                  [c.finish_reason for c in flat], metas, k).reshape(len(prompts), k)
  lp_ref = ref_scorer.sequence_logprobs([list(p) for p in prompts for _ in range(k)],
                                        [c.token_ids.tolist() for c in flat]).reshape(len(prompts), k)
  lp_pol = np.asarray([[float(np.sum(c.raw_logprobs, dtype=np.float64)) for c in cs]
                       for cs in comps])
  per = []
  for i, e in enumerate(exact):
    mc = monte_carlo_terms(lp_pol[i], lp_ref[i], reward[i], e, beta)
    if wrong is not None:
      mc.update(p_wrong_kl_wrong=wrong[i][0], p_wrong_kl_wrong_se=wrong[i][1], kl_wrong=wrong[i][2])
    per.append({**codec.encode(e), **mc, "kl_decomposed": e.kl_binary + e.p_correct * e.kl_correct
                + mc["p_wrong_kl_wrong"]})
  means: dict[str, float] = {}
  for key in ("p_correct", "p_correct_target", "entropy_correct", "target_entropy_correct",
              "kl_binary", "kl_correct", "kl_decomposed", "kl_mc", "log_z", "tb_sq",
              "p_wrong_kl_wrong"):
    means[key] = float(np.asarray([p[key] for p in per], np.float64).mean())
  # Standard errors over prompts of the Monte Carlo means: combine the per-prompt MC errors. The
  # decomposition's only Monte Carlo term is P_w KL(pi|w || pi~|w), so its error is that term's.
  for key in ("kl_mc", "p_wrong_kl_wrong"):
    se = np.asarray([p[f"{key}_se"] for p in per], np.float64)
    means[f"{key}_se"] = float(np.sqrt(np.sum(se ** 2)) / len(per))
  means["kl_decomposed_se"] = means["p_wrong_kl_wrong_se"]
  cond = [p["kl_wrong"] for p in per if np.isfinite(p["kl_wrong"])]
  means["kl_wrong"] = float(np.mean(cond)) if cond else float("nan")
  means["p_correct_kl_correct"] = float(np.mean([p["p_correct"] * p["kl_correct"] for p in per]))
  return ExactMeasures(means=means, samples_per_prompt=k, per_prompt=tuple(per),
                       wrong_samples_per_prompt=wrong_k)
