"""Sampling the policy restricted to the wrong answers (the exact decomposition's sampled term).

The decomposition of `disa_jax.eval.exact` leaves one term to Monte Carlo: P_w KL(pi|w || pi~|w),
where pi|w is the policy conditioned on a wrong answer. Estimated from plain policy samples
(`disa_jax.eval.exact.wrong_term`) it rests on the few samples that happen to be wrong: near the end
state P_w is ~0.003, a measurement of 8 prompts x 32 samples draws 0-2 wrong answers, and each adds
~4 nats / 256 to the mean, so the term's noise (SD ~0.014 nats) is that of a rare event, not of the
KL. When the correct set is enumerated, pi|w itself can be sampled exactly: decode token by token,
giving each next token v after the prefix h its *wrong* mass

    q(v | h) = pi(v | h) (1 - P(correct | h v)) / (1 - P(correct | h)),
    P(correct | x) = sum over the correct answers c extending x of pi(c_{|x|:} | x),

the second factor computed from the correct answers' own per-token log-probs (a token off every
correct answer's path keeps pi(v | h): all its continuations are wrong). Every sample is a wrong
answer, drawn with probability pi(o) / P_w, so

    P_w KL(pi|w || pi~|w) = P_w E_{pi|w}[log pi(o) - log pi_ref(o) - log P_w + log P_ref(w)]

is estimated from K wrong samples per prompt with standard error P_w sd / sqrt(K) (`conditional_wrong_term`):
no measurement rests on whether a wrong answer happened to be drawn.

`sample_wrong` decodes with the policy's own scorer (`SequenceScorer.next_token_logprobs`, one full
forward per token of the rows still decoding, in a buffer of fixed width: the exact tracker's tasks have answers of
a few tokens) and returns log pi(o) from the same passes; the probabilities are float32 log-softmaxes combined in float64, so the distribution is
exact up to float32 rounding of P(correct | x) (a prefix whose wrong mass rounds to zero is not
extended; if every token of an on-path prefix rounds to zero, the tokens off every correct answer's
path are sampled, which are wrong by construction).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class PrefixTrie:
  """The prefixes of one prompt's correct answers, built once (the answers do not change while the
  policy trains): each prefix's index, the next tokens on a correct path after it, and for every
  answer token the slot of its suffix sum (see `CorrectPrefixes`).

  Args:
    answers: ``[C]`` correct responses (token ids, stop token included).
  """

  def __init__(self, answers: Sequence[Sequence[int]]):
    self.lengths = np.asarray([len(a) for a in answers], np.int64)  # [C]
    self.index: dict[tuple[int, ...], int] = {}  # prefix -> its slot in the masses
    self.children: dict[tuple[int, ...], set[int]] = {}  # prefix -> next tokens on a path
    ids = []  # the prefix of every (answer, j <= len): answer-major
    for a in answers:
      a = tuple(int(t) for t in a)
      for j in range(len(a) + 1):
        ids.append(self.index.setdefault(a[:j], len(self.index)))
        if j < len(a):
          self.children.setdefault(a[:j], set()).add(a[j])
    self.prefix_ids = np.asarray(ids, np.int64)  # [sum(len + 1)]
    width = int(self.lengths.max(initial=0))
    # Answer c's token i goes to column len_c - 1 - i of its row (the row reversed, zeros after),
    # so a row's cumulative sum at len_c - 1 - j is sum over i >= j of lp_i, added from the end.
    self._rows = np.repeat(np.arange(len(answers)), self.lengths)
    self._cols = np.concatenate([np.arange(n - 1, -1, -1) for n in self.lengths]
                                + [np.zeros(0, np.int64)]).astype(np.int64)
    self._width = width
    # The (answer, j) entries of `prefix_ids` read column len_c - 1 - j of the sums (j < len_c)
    # or nothing (j = len_c: the answer itself, suffix 0).
    j = np.concatenate([np.arange(n + 1) for n in self.lengths] + [np.zeros(0, np.int64)])
    n_of = np.repeat(self.lengths, self.lengths + 1)
    self._read_row = np.repeat(np.arange(len(answers)), self.lengths + 1)
    self._read_col = np.maximum(n_of - 1 - j, 0)
    self._is_end = j == n_of

  def suffix_mass(self, token_logprobs: Sequence[np.ndarray]) -> np.ndarray:
    """``[num prefixes]`` P(correct | prefix): per answer and prefix length j, exp of the sum of
    the answer's log-probs from token j on (summed from the last token, in float64), added up per
    prefix in answer order."""
    flat = np.concatenate([np.asarray(lp, np.float64).reshape(-1) for lp in token_logprobs]
                          + [np.zeros(0)])
    rev = np.zeros((self.lengths.size, max(self._width, 1)))
    rev[self._rows, self._cols] = flat
    sums = np.cumsum(rev, axis=1)  # [C, width] sequential along each row
    suffix = np.where(self._is_end, 0.0, sums[self._read_row, self._read_col])
    return np.bincount(self.prefix_ids, weights=np.exp(suffix), minlength=len(self.index))


class CorrectPrefixes:
  """P(correct | x) under the policy for every prefix x of a prompt's correct answers.

  Args:
    answers: ``[C]`` correct responses (token ids, stop token included).
    token_logprobs: ``[C]`` arrays of their per-token log-probs under the policy.
    trie: the answers' `PrefixTrie`, when the caller keeps one (built here otherwise).
  """

  def __init__(self, answers: Sequence[Sequence[int]], token_logprobs: Sequence[np.ndarray], *,
               trie: PrefixTrie | None = None):
    if len(answers) != len(token_logprobs):
      raise ValueError(f"CorrectPrefixes needs one log-prob array per answer, got {len(answers)} "
                       f"answers and {len(token_logprobs)} arrays")
    trie = trie if trie is not None else PrefixTrie(answers)
    if trie.lengths.size != len(answers):
      raise ValueError(f"CorrectPrefixes got a PrefixTrie of {trie.lengths.size} answers for "
                       f"{len(answers)} answers")
    for a, n, lp in zip(answers, trie.lengths, token_logprobs):
      if np.shape(lp) != (n,):
        raise ValueError(f"correct answer {tuple(int(t) for t in a)} has {n} tokens but log-probs "
                         f"of shape {np.shape(lp)}")
    self._index, self._children = trie.index, trie.children
    self._mass = trie.suffix_mass(token_logprobs)  # [num prefixes]

  def p_correct(self, prefix: Sequence[int]) -> float:
    """P(correct | prefix), at most 1 (0 for a prefix off every correct answer's path)."""
    at = self._index.get(tuple(prefix))
    return 0.0 if at is None else min(float(self._mass[at]), 1.0)

  def on_path(self, prefix: Sequence[int]) -> bool:
    """Whether ``prefix`` continues into some correct answer (its next tokens' mass changes)."""
    return tuple(prefix) in self._children

  def wrong_logits(self, prefix: Sequence[int], logp: np.ndarray) -> np.ndarray:
    """``[V]`` log of the unnormalised wrong mass log pi(v | h) + log(1 - P(correct | h v)).

    Where every token's wrong mass rounds to zero (`sample_wrong`'s fallback), the tokens on a
    correct answer's path get -inf and the others keep log pi(v | h).
    """
    out = np.asarray(logp, np.float64).copy()
    kids = sorted(self._children.get(tuple(prefix), ()))
    for v in kids:
      rest = 1.0 - self.p_correct(tuple(prefix) + (v,))
      out[v] = out[v] + np.log(rest) if rest > 0 else -np.inf
    if not np.isfinite(out).any():
      out = np.asarray(logp, np.float64).copy()
      out[kids] = -np.inf
    return out


DECODES = ("full", "cached")  # how `sample_wrong` gets each next-token distribution


def sample_wrong(scorer: Any, prompts: Sequence[Sequence[int]], prefixes: Sequence[CorrectPrefixes],
                 k: int, *, max_tokens: int, stop_ids: Sequence[int], pad_id: int,
                 rng: np.random.Generator, decode: str = "full"
                 ) -> tuple[list[list[list[int]]], np.ndarray]:
  """``[P][k]`` responses drawn from the policy conditioned on a wrong answer (module docstring),
  and ``[P, k]`` their log-probs under the policy itself, log pi(o), from the same forward passes.

  Args:
    scorer: the policy's `SequenceScorer` (`next_token_logprobs`).
    prompts: ``[P]`` prompt token ids.
    prefixes: ``[P]`` each prompt's `CorrectPrefixes` under the same policy.
    k: samples per prompt.
    max_tokens: the response limit (a response cut there is one outcome, as in the policy's
      sampling).
    stop_ids: tokens that end a response (kept in it).
    pad_id: the padding token of the decoding buffer.
    rng: the draws' generator.
    decode: 'full' (the reference): every token a forward over the whole buffer
      (`SequenceScorer.next_token_logprobs`); 'cached': the prompts once, then one token per row
      through a KV cache (`SequenceScorer.decoder`): the same distributions up to float32
      rounding, so the same draws but where a Gumbel maximum is that close.
  """
  if decode not in DECODES:
    raise ValueError(f"sample_wrong decode must be one of {DECODES}, got {decode!r}")
  if len(prompts) != len(prefixes) or k < 1:
    raise ValueError(f"sample_wrong needs one CorrectPrefixes per prompt and k >= 1, got "
                     f"{len(prompts)} prompts, {len(prefixes)} prefix sets, k={k}")
  width = max(len(p) for p in prompts)
  rows = [i for i in range(len(prompts)) for _ in range(k)]
  ids = np.full((len(rows), width + max_tokens), pad_id, np.int32)
  mask = np.zeros_like(ids)
  for r, i in enumerate(rows):
    ids[r, width - len(prompts[i]):width], mask[r, width - len(prompts[i]):width] = prompts[i], 1
  responses: list[list[int]] = [[] for _ in rows]
  logprob = np.zeros(len(rows))  # log pi(o) of each response (not of pi|w)
  live = np.ones(len(rows), bool)
  stops = {int(t) for t in stop_ids}
  decoder = scorer.decoder(ids[:, :width], mask[:, :width], max_tokens) if decode == "cached" \
      else None
  for t in range(max_tokens):
    todo = np.flatnonzero(live)
    if todo.size == 0:
      break
    if decoder is None:
      logp = scorer.next_token_logprobs(ids[todo], mask[todo], np.full(todo.size, width + t - 1)
                                        ).astype(np.float64)
    else:  # (a finished row is fed its pad and its distribution is not read)
      logp = (decoder.step(ids[:, width + t - 1]) if t else decoder.logprobs)[todo]
    logits = logp.copy()
    for j, row in enumerate(todo):  # only rows on a correct answer's path change
      if prefixes[rows[row]].on_path(responses[row]):
        logits[j] = prefixes[rows[row]].wrong_logits(responses[row], logits[j])
    picked = np.argmax(logits + rng.gumbel(size=logits.shape), axis=-1)  # one draw per row
    for j, (row, v) in enumerate(zip(todo, picked.tolist())):
      responses[row].append(v)
      logprob[row] += logp[j, v]
      ids[row, width + t], mask[row, width + t] = v, 1
      live[row] = v not in stops
  return ([[responses[i * k + j] for j in range(k)] for i in range(len(prompts))],
          logprob.reshape(len(prompts), k))


def conditional_wrong_term(lp_policy: np.ndarray, lp_ref: np.ndarray, p_correct: float,
                           p_correct_ref: float) -> tuple[float, float, float]:
  """P_w KL(pi|w || pi~|w) from K samples of pi|w (`sample_wrong`), its SE, and KL(pi|w || pi~|w).

  Args:
    lp_policy, lp_ref: ``[K]`` trajectory log-probs of the K wrong samples under the policy and
      pi_ref.
    p_correct, p_correct_ref: the exact P_c under the policy and under pi_ref.

  Returns:
    (estimate, standard error over the K samples (NaN for K = 1), the conditional KL estimate).
  """
  pw, pw_ref = 1.0 - p_correct, 1.0 - p_correct_ref
  if not pw > 0:
    return 0.0, 0.0, float("nan")
  if not pw_ref > 0:
    raise ValueError(f"the policy gives wrong answers mass {pw!r} but P_ref(wrong) = {pw_ref!r}: "
                     "pi~ gives them none")
  ell = (np.asarray(lp_policy, np.float64) - np.log(pw)) - (np.asarray(lp_ref, np.float64)
                                                             - np.log(pw_ref))
  kl = float(ell.mean())
  se = float(ell.std(ddof=1) / np.sqrt(ell.size)) if ell.size > 1 else float("nan")
  return pw * kl, pw * se, kl
