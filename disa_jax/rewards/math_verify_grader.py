"""In-process math grading with math-verify (no time bound of its own; see `math_pool`).

`grade(response, ground_truth)` extracts the response's final answer, expands the ground truth into
its acceptable alternatives, and accepts when math-verify finds any (gold variant, prediction
variant) pair equal. Raw strings are tried first; the normalised variants of
`disa_jax.rewards.math_answer` only after the raw pair fails.

math-verify's own SIGALRM timeouts are turned off here (`parsing_timeout=None`,
`timeout_seconds=None`): they only work in a main thread and cannot interrupt C-level big-integer
arithmetic. The wall-clock bound is enforced by the worker pool in `disa_jax.rewards.math_pool`,
which kills a stuck worker. Call `grade` directly only on trusted input.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from disa_jax.rewards import math_answer

__all__ = ["grade", "grade_raw", "MAX_ANSWER_CHARS"]

# An extracted answer longer than this is graded 0 without parsing (no real answer is this long;
# megabyte-long "answers" are a denial-of-service on the LaTeX parser).
MAX_ANSWER_CHARS = 2000


@functools.lru_cache(maxsize=1)
def _mv():
  """Imports math-verify lazily (it pulls in sympy) and silences its timeout warnings."""
  import math_verify  # pylint: disable=g-import-not-at-top  (heavy import: sympy)
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  gold_cfg = (math_verify.LatexExtractionConfig(boxed_match_priority=0),)
  pred_cfg = (math_verify.LatexExtractionConfig(boxed_match_priority=0),
              math_verify.ExprExtractionConfig())
  return math_verify, gold_cfg, pred_cfg


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str):
  mv, gold_cfg, _ = _mv()
  return tuple(mv.parse("\\boxed{" + answer + "}", extraction_config=gold_cfg,
                        parsing_timeout=None))


@functools.lru_cache(maxsize=4096)
def _parse_pred(answer: str):
  mv, _, pred_cfg = _mv()
  return tuple(mv.parse("\\boxed{" + answer + "}", extraction_config=pred_cfg,
                        parsing_timeout=None))


def _equal(gold: str, pred: str) -> bool:
  """math-verify equality of two answer strings (gold first: verify is not symmetric)."""
  mv = _mv()[0]
  g = _parse_gold(gold)
  p = _parse_pred(pred)
  if not g or not p:
    return False
  return bool(mv.verify(list(g), list(p), timeout_seconds=None))


def grade(response: str, ground_truth: Any) -> bool:
  """Whether the final answer of `response` matches `ground_truth` (normalised, see module doc).

  Args:
    response: the model's response text.
    ground_truth: an answer string, a number, or a list of acceptable answers.

  Returns:
    True when correct.
  """
  pred = math_answer.extract_final_answer(response)
  if pred is None or len(pred) > MAX_ANSWER_CHARS:
    return False
  golds = math_answer.ground_truth_alternatives(ground_truth)
  pred_vars = math_answer.answer_variants(pred)
  for gold in golds:
    gold_vars = math_answer.answer_variants(gold)
    # Raw pair first, then every pair of variants (the lists are short: typically 1-3 each).
    for gv in gold_vars:
      for pv in pred_vars:
        if _equal(gv, pv):
          return True
  return False


def grade_raw(response: str, ground_truth: str) -> bool:
  """Plain math-verify, the baseline the normalisations are measured against.

  The gold is parsed as `$ground_truth$`; the response is parsed whole by math-verify's own
  extraction (LaTeX with boxed priority, then expressions), as in math-verify's README.

  Args:
    response: the model's response text.
    ground_truth: the answer string.

  Returns:
    True when math-verify accepts.
  """
  mv = _mv()[0]
  gold = mv.parse("$" + str(ground_truth) + "$", parsing_timeout=None)
  pred = mv.parse(response, parsing_timeout=None)
  if not gold or not pred:
    return False
  return bool(mv.verify(gold, pred, timeout_seconds=None))
