"""The main job's synthetic task: "Give two non-negative integers that sum to n", with an exact Z.

Prompt ``"Give two non-negative integers that sum to {n}:"``; a response is correct iff its tokens are
exactly the canonical tokenisation of ``" {a}+{b}"`` followed by EOS, with a + b = n and a, b written
without leading zeros. Every correct response is therefore one of the n + 1 enumerable sequences
``correct_completions(n)``, and with a binary reward and the raw transform

    Z(q) = sum_o pi_ref(o|q) exp(beta r(q, o)) = 1 + (e^beta - 1) * P_ref(correct | q),

    P_ref(correct | q) = sum_{a=0..n} pi_ref(" a+(n-a)" EOS | q),

so log Z is exact once the n + 1 correct completions are scored under pi_ref
(`disa_jax.eval.exact.exact_log_z` of their log-sum-exp). The
task's tokenizer (`make_tokenizer`) is character-level for digits, so each string has exactly one
tokenisation, which the reward checks.

The whole task lives here: its tokenizer, prompt template, verifier, the 'sum_task' reward
(registered with `disa_jax.tasks.registry.register_task` when this module is imported, as
`disa_jax.tasks` does, together with its enumerable correct set `correct_set`, the exact target of
`disa_jax.eval.exact`). The main job writes its prompts as veRL rows (`disa_jax.pipeline.sum_job`),
read back by the veRL format (`disa_jax.tasks.verl`; the ground truth n as text).
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax.data import tokenizer as tokenizer_lib
from disa_jax.rewards.graded import Response
from disa_jax.tasks import registry
from disa_jax.tasks.base import Task

PROMPT_TEMPLATE = "Give two non-negative integers that sum to {n}:"
WORDS = ("Give", "two", "non", "negative", "integers", "that", "sum", "to")
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
_ANSWER = re.compile(r" (0|[1-9][0-9]*)\+(0|[1-9][0-9]*)")


def make_tokenizer():
  """Word tokens for the prompt words, one token per other character; ids 0..3 = pad, bos, eos, unk.

  Built with the `tokenizers` library and wrapped as a `transformers` fast tokenizer (so it saves
  and reloads with ``AutoTokenizer``).
  """
  # Heavy imports (transformers: ~1 s), needed only to build the tokenizer.
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  PreTrainedTokenizerFast = tokenizer_lib.transformers_class("PreTrainedTokenizerFast")  # (thread-safe)
  chars = [chr(c) for c in range(32, 127)] + ["\n"]
  vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, UNK, *WORDS, *chars])}
  tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
  # whole known words, otherwise one token per character (so digits are always single tokens)
  tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\b(?:" + "|".join(WORDS) + r")\b|[\s\S]"), behavior="isolated")
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([PAD, BOS, EOS, UNK])
  return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                 unk_token=UNK, padding_side="left", clean_up_tokenization_spaces=False,
                                 model_max_length=256)


@dataclasses.dataclass(frozen=True)
class SumTask:
  """Prompts n = n_min..n_max and their verifier.

  Attributes:
    n_min, n_max: range of n (inclusive); n + 1 correct answers per prompt.
  """

  n_min: int = 0
  n_max: int = 40

  def __post_init__(self):
    if not 0 <= self.n_min <= self.n_max:
      raise ValueError(f"SumTask needs 0 <= n_min <= n_max, got n_min={self.n_min}, n_max={self.n_max}")

  @property
  def ns(self) -> list[int]:
    return list(range(self.n_min, self.n_max + 1))

  def prompt(self, n: int) -> str:
    return PROMPT_TEMPLATE.format(n=n)

  def prompt_id(self, n: int) -> str:
    return f"sum{n:04d}"

  @staticmethod
  def answer_text(a: int, b: int) -> str:
    return f" {a}+{b}"

  def correct_completions(self, tokenizer, n: int) -> list[list[int]]:
    """The n + 1 correct responses as token ids (each ending with EOS), a = 0..n."""
    return [tokenizer.encode(self.answer_text(a, n - a), add_special_tokens=False) + [tokenizer.eos_token_id]
            for a in range(n + 1)]

  def parse(self, tokenizer, token_ids: Sequence[int]) -> tuple[int, int] | None:
    """(a, b) if ``token_ids`` is a canonical ``" a+b" EOS`` response, else None."""
    ids = list(token_ids)
    if not ids or ids[-1] != tokenizer.eos_token_id:
      return None
    text = tokenizer.decode(ids[:-1], skip_special_tokens=False)
    m = _ANSWER.fullmatch(text)
    if m is None:
      return None
    a, b = int(m.group(1)), int(m.group(2))
    if tokenizer.encode(self.answer_text(a, b), add_special_tokens=False) != ids[:-1]:
      return None  # a non-canonical tokenisation of the same string is not an enumerated answer
    return a, b

  def reward(self, tokenizer, n: int, token_ids: Sequence[int]) -> float:
    """1.0 iff the response is one of ``correct_completions(n)``."""
    pair = self.parse(tokenizer, token_ids)
    return 1.0 if pair is not None and pair[0] + pair[1] == n else 0.0


@functools.lru_cache(maxsize=1)
def task_tokenizer():
  """The task's tokenizer (`make_tokenizer`), built once per process."""
  return make_tokenizer()


def _n_of(meta: Mapping[str, Any], i: int) -> int:
  gt = meta.get("ground_truth") if isinstance(meta, Mapping) else None
  try:
    n = int(str(gt).strip())
  except ValueError:
    raise ValueError(f"sum_task metas[{i}]['ground_truth'] must be the integer n, got {gt!r}") from None
  if n < 0:
    raise ValueError(f"sum_task metas[{i}]['ground_truth'] must be >= 0, got {n}")
  return n


def sum_task_rewards(token_ids: Sequence[Sequence[int]],
                     metas: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """The registered 'sum_task' reward: 1.0 iff a response is one of n's canonical answers.

  Args:
    token_ids: n generated token-id sequences (stop token included).
    metas: n dicts with ``ground_truth`` = the prompt's n (an int or its decimal string).

  Returns:
    ``[n]`` float32 rewards.
  """
  return np.asarray([_task_reward(_n_of(m, i), tuple(ids))
                     for i, (ids, m) in enumerate(zip(token_ids, metas))], np.float32)


@functools.lru_cache(maxsize=1 << 16)
def _task_reward(n: int, token_ids: tuple[int, ...]) -> float:
  """`SumTask.reward` with the task's tokenizer, remembered per (n, response): a run grades the
  same few hundred short responses again and again, and each grading decodes and re-encodes."""
  return SumTask(0, 0).reward(task_tokenizer(), n, list(token_ids))


def sum_task_reward_fn(responses: Sequence[Response],
                       metas: Sequence[Mapping[str, Any]]) -> np.ndarray:
  """The 'sum_task' `RewardFn` body: `sum_task_rewards` of the responses' token ids.

  Args:
    responses: n `Response` objects (their ``token_ids`` are graded).
    metas: n dicts with ``ground_truth`` = the prompt's n.

  Returns:
    ``[n]`` float32 rewards.
  """
  return sum_task_rewards([r.token_ids for r in responses], metas)


def correct_set(tokenizer, meta: Mapping[str, Any]) -> list[list[int]]:
  """Every correct response of the prompt whose meta is ``meta`` (the exact evaluator's input).

  Args:
    tokenizer: the task's tokenizer (`make_tokenizer`).
    meta: the prompt's reward meta, ``{"ground_truth": n}``.

  Returns:
    ``[n + 1]`` token-id lists `` a+(n-a)`` EOS, a = 0..n.
  """
  return SumTask(0, 0).correct_completions(tokenizer, _n_of(meta, 0))


TASK = Task("sum_task", correct_set=correct_set)
registry.register_task(TASK, reward=sum_task_reward_fn)

