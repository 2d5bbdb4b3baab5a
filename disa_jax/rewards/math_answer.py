"""Final-answer extraction and answer-string normalisation for math grading.

Pure string functions (no sympy, no math-verify) that run in linear time on any input, so that they
are safe to call on untrusted model output of any length: the extraction scans the text
explicitly (no backtracking regular expression sees the whole response), and the normalisation
only runs on answers of at most `MAX_NORMALISE_CHARS` characters. `disa_jax.rewards.math` feeds
their output to math-verify.

Extraction (`extract_final_answer`): the content of the last `\\boxed{...}` / `\\fbox{...}` (or
`\\boxed 5`); failing that, the last "final answer is ..." phrase; failing that, the last
"Answer: ..." line. No "last number in the text" fallback: a response that states no answer gets 0.

Normalisation (`answer_variants`): the forms of an answer string that raw math-verify misreads but
that mean the same number, each of which is tried only after the raw string fails:

- AIME zero padding: `025` -> `25` (integers only; `0.25` is untouched);
- scientific notation: `1.5e3`, `1.5E+03`, `1.5 \\times 10^{3}`, `1.5\\cdot10^3` -> `1500` and
  `1.5\\times 10^{3}`;
- units after a number: `10\\text{ cm}`, `10 \\mathrm{m/s}`, `45^\\circ`, `45 degrees`, `50\\%`,
  `\\$ 5` -> the number;
- `\\text{...}` / `\\mathrm{...}` wrappers around a whole answer, `\\left`/`\\right`, `\\!`,
  `\\dfrac`.

Every variant is derived from the string alone, so a wrong number never becomes a right one: the
variants only strip decoration that carries no numeric value.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any

__all__ = [
  "extract_boxed",
  "extract_final_answer",
  "answer_variants",
  "answer_key",
  "ground_truth_alternatives",
]

_BOX_COMMANDS = ("\\boxed", "\\fbox")
MAX_NORMALISE_CHARS = 2000
# The unit-stripping regex backtracks (about n^2 x its alternatives): it only sees answers this
# short; a number with units is a few dozen characters.
MAX_UNIT_CHARS = 100


def _match_brace(text: str, open_idx: int) -> int:
  """Index of the `}` matching the `{` at `open_idx`, or -1 if unbalanced.

  Args:
    text: the string.
    open_idx: index of an opening brace in `text`.

  Returns:
    The index of the matching closing brace, or -1.
  """
  depth = 0
  i = open_idx
  n = len(text)
  while i < n:
    c = text[i]
    if c == "\\":  # skip escaped characters such as \{ and \}
      i += 2
      continue
    if c == "{":
      depth += 1
    elif c == "}":
      depth -= 1
      if depth == 0:
        return i
    i += 1
  return -1


def extract_boxed(text: str) -> str | None:
  """Content of the last `\\boxed{...}` or `\\fbox{...}` in `text` (nested braces handled).

  Also accepts the brace-less form `\\boxed 5` (one token). Returns None when there is none or
  when the last one is unbalanced.

  Args:
    text: a model response or a reference solution.

  Returns:
    The boxed content, stripped, or None.
  """
  # The last occurrence of each command before the current candidate; only the command just
  # rejected searches again (further left), so each part of the text is searched once per command.
  last = {cmd: text.rfind(cmd) for cmd in _BOX_COMMANDS}
  while True:
    best_cmd = max(_BOX_COMMANDS, key=lambda c: last[c])
    best = last[best_cmd]
    if best < 0:
      return None
    k = best + len(best_cmd)
    # Skip whitespace between the command and its argument.
    while k < len(text) and text[k] in " \t":
      k += 1
    if k < len(text) and text[k] == "{":
      end = _match_brace(text, k)
      if end < 0:
        return None
      return text[k + 1:end].strip()
    if k > best + len(best_cmd) and k < len(text):
      # `\boxed 5`: the argument is the next whitespace/`$`-delimited token.
      m = _TOKEN_RE.match(text, k)  # in place: a slice here would copy the rest of the text
      if m:
        return m.group(0).strip()
    # `\boxedfoo` is another command: look further left.
    last[best_cmd] = text.rfind(best_cmd, 0, best)


_TOKEN_RE = re.compile(r"[^\s$]+")
# Each of these is a literal or a single repeated class: a match runs once over its span, with no
# backtracking, so every use below is linear in what it reads.
_FINAL_PHRASE_RE = re.compile("final answer is", re.IGNORECASE)
_ANSWER_WORD_RE = re.compile("answer", re.IGNORECASE)
_SPACE_RE = re.compile(r"\s*")
_STARS_RE = re.compile(r"\**")
_COLONS = ":\uff1a"


def _skip_space(text: str, i: int) -> int:
  """The first index >= i that is not whitespace (newlines included), or len(text)."""
  return _SPACE_RE.match(text, i).end()


def _phrase_answer_end(text: str, i: int) -> int:
  """End of a "final answer is" answer starting at i (a non-space character).

  The answer runs to the end of its line, or to an earlier `.` followed (after whitespace) by
  "I hope" or by the end of the text. Each `.` looks ahead only over the whitespace that follows
  it (up to the next `.` at the latest): linear time.
  """
  n = len(text)
  line_end = text.find("\n", i + 1)
  line_end = n if line_end < 0 else line_end
  j = text.find(".", i + 1, line_end)
  while j >= 0:
    k = _skip_space(text, j + 1)
    if k == n or text[k:k + 6].lower() == "i hope":
      return j
    j = text.find(".", j + 1, line_end)
  return line_end


def _last_final_answer_phrase(text: str) -> str | None:
  """The answer of the last "final answer is[:] X" (Minerva style), or None.

  Occurrences are read left to right, each one's answer ending as `_phrase_answer_end` says; an
  occurrence inside an earlier one's answer is part of that answer. Whitespace (newlines included)
  and one colon may sit between the phrase and the answer; an occurrence followed only by
  whitespace states nothing.
  """
  last = None
  pos = 0
  n = len(text)
  while True:
    m = _FINAL_PHRASE_RE.search(text, pos)
    if m is None:
      return last
    i = _skip_space(text, m.end())
    if i < n and text[i] in _COLONS:
      i = _skip_space(text, i + 1)
    if i >= n:
      return last
    pos = _phrase_answer_end(text, i)
    last = text[i:pos]


def _starts_a_line(text: str, i: int) -> bool:
  """Whether only `*`s, then whitespace holding a line break (or the text's start), precede i.

  Reads backwards over the `*`s and whitespace right before i only; those runs of two different
  occurrences of "answer" do not overlap, so all calls together read the text at most once.
  """
  while i > 0 and text[i - 1] == "*":
    i -= 1
  while i > 0 and text[i - 1].isspace():
    if text[i - 1] == "\n":
      return True
    i -= 1
  return i == 0


def _answer_line_body(text: str, k: int) -> tuple[str, int] | None:
  """After "answer" at k: `*`s, whitespace, a colon, whitespace, `*`s, then X to its line's end.

  Returns:
    (X less trailing whitespace and `*`s, the end of X's line), or None when the colon or X is
    missing.
  """
  n = len(text)
  k = _skip_space(text, _STARS_RE.match(text, k).end())
  if k >= n or text[k] not in _COLONS:
    return None
  k = _STARS_RE.match(text, _skip_space(text, k + 1)).end()
  if k >= n or text[k] == "\n":
    return None
  line_end = text.find("\n", k)
  line_end = n if line_end < 0 else line_end
  return text[k:line_end].rstrip().rstrip("*"), line_end


def _last_answer_line(text: str) -> str | None:
  """X of the last "Answer: X" line, or None; linear time.

  Such a line starts (after whitespace and `*`s) with "answer" in any case, then `*`s, whitespace,
  a colon, whitespace, `*`s and X (which may start on a later line), so `**Answer:** 7` gives 7.
  """
  last = None
  pos = 0
  while True:
    m = _ANSWER_WORD_RE.search(text, pos)
    if m is None:
      return last
    found = _answer_line_body(text, m.end()) if _starts_a_line(text, m.start()) else None
    if found is None:
      pos = m.end()
    else:
      last, pos = found


def _strip_math_delims(s: str) -> str:
  """Strips surrounding `$`, `\\(`/`\\)`, `\\[`/`\\]`, a trailing period and spaces."""
  s = s.strip()
  for _ in range(3):
    s = s.strip().rstrip(".").strip()
    if s.startswith("$$") and s.endswith("$$") and len(s) >= 4:
      s = s[2:-2]
    elif s.startswith("$") and s.endswith("$") and len(s) >= 2:
      s = s[1:-1]
    elif (s.startswith("\\(") and s.endswith("\\)")) or (s.startswith("\\[") and s.endswith("\\]")):
      s = s[2:-2]
  return s.strip()


def extract_final_answer(response: str) -> str | None:
  """The final answer stated in a model response, as a string, or None.

  Order: last boxed answer; last "final answer is X" (Minerva style); last "Answer: X" line.

  Args:
    response: the full response text.

  Returns:
    The answer string (math delimiters stripped) or None when the response states no answer.
  """
  boxed = extract_boxed(response)
  if boxed is not None:
    return boxed if boxed else None
  for find_last in (_last_final_answer_phrase, _last_answer_line):
    last = find_last(response)
    if last is not None:
      inner = extract_boxed(last)
      ans = _strip_math_delims(inner if inner is not None else last)
      if ans:
        return ans
  return None


# ----------------------------------------------------------------------------------------------
# Normalisation.
# ----------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_UNIT_WORDS = (
  r"(?:degrees?|deg|cm|mm|km|m|meters?|metres?|inches|inch|in|feet|foot|ft|miles?|mi|units?|"
  r"seconds?|sec|s|minutes?|min|hours?|hrs?|h|days?|weeks?|years?|dollars?|cents?|"
  r"grams?|g|kg|pounds?|lbs?|liters?|litres?|L|ml|mL|sq|square|cubic|"
  r"m/s|km/h|mph|cm\^2|m\^2|cm\^3|m\^3|J|N|W|V|K|Pa|Hz|mol|eV|kJ|atm)")
_TEXT_WRAP_RE = re.compile(r"^\\(?:text|mathrm|textbf|mbox|operatorname)\{([^{}]*)\}$")
_SCI_E_RE = re.compile(r"^(" + _NUM + r")\s*[eE]\s*([-+]?\d+)$")
_SCI_TIMES_RE = re.compile(
  r"^(" + _NUM + r")\s*(?:\\times|\\cdot|\*|x|×)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?$")
_POW10_RE = re.compile(r"^10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?$")
_ZERO_PAD_RE = re.compile(r"^([-+]?)0+(\d+)$")
_UNIT_TAIL_RE = re.compile(
  r"^(.*?\d\}?)\s*(?:"
  r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\%|%|"
  r"\\(?:text|mathrm|mbox|textrm|operatorname)\s*\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?|"
  r"(?:\\[,;!])?\s*" + _UNIT_WORDS + r"(?:\s*\^\s*\{?\d\}?)?(?:\s+" + _UNIT_WORDS + r")?"
  r")\s*\.?$")
_CURRENCY_HEAD_RE = re.compile(r"^(?:\\\$|\$|\\text\{\s*\\?\$\s*\})\s*(.*\d.*)$")


def _canonical(s: str) -> str:
  """Cosmetic LaTeX clean-up that never changes a value."""
  s = s.strip()
  s = s.replace("\\left", "").replace("\\right", "")
  s = s.replace("\\!", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = re.sub(r"\\[,;:]\s*", "", s) if re.fullmatch(r"[\d\\,;:.\s]+", s) else s  # 1\,000 -> 1000
  s = s.strip().rstrip(".").strip()
  return s


def _number_like(s: str) -> bool:
  """Whether `s` is a bare number, fraction or simple numeric LaTeX expression."""
  return bool(re.fullmatch(r"[-+]?[\d.,\s]*\d[\d.,\s]*|[-+]?\\frac\{[^{}]+\}\{[^{}]+\}|"
                           r"[-+]?\d+\s*/\s*\d+|[-+]?\d*\\sqrt\{?[^{}]+\}?|[-+]?\d*\\pi", s))


def answer_variants(answer: str) -> list[str]:
  """Equivalent rewritings of an answer string, the original first, no duplicates.

  Args:
    answer: an extracted answer or a ground-truth string (no surrounding `$`).

  Returns:
    A list of strings, `[answer, variant_1, ...]`; when `answer` is e-notation (`2e3`), the raw
    form is left out, because LaTeX reads it as `2 * e * 3`. Answers longer than
    `MAX_NORMALISE_CHARS` are returned alone, and units are only stripped from answers of at most
    `MAX_UNIT_CHARS` (the regexes backtrack; these caps bound their time per answer).
  """
  if len(answer) > MAX_NORMALISE_CHARS:
    return [answer]
  out = [] if _SCI_E_RE.match(_strip_math_delims(answer).strip()) else [answer]

  def add(s: str) -> None:
    s = s.strip()
    if s and s not in out and not _SCI_E_RE.match(s):
      out.append(s)

  s = _canonical(_strip_math_delims(answer))
  add(s)
  for _ in range(2):  # Unwrap at most two layers of text wrappers / units.
    m = _TEXT_WRAP_RE.match(s)
    if m:
      s = m.group(1).strip()
      add(s)
    m = _CURRENCY_HEAD_RE.match(s)
    if m:
      s = m.group(1).strip()
      add(s)
    m = _UNIT_TAIL_RE.match(s) if len(s) <= MAX_UNIT_CHARS else None
    if m and _number_like(_canonical(m.group(1))):
      s = _canonical(m.group(1))
      add(s)
  m = _ZERO_PAD_RE.match(s)
  if m:
    add(m.group(1) + str(int(m.group(2))))
  if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+", s):  # 1,000,000 as a thousands-separated integer
    add(s.replace(",", ""))
  for regex in (_SCI_E_RE, _SCI_TIMES_RE):
    m = regex.match(s)
    if m:
      mant, exp = m.group(1), int(m.group(2))
      add(f"{mant}\\times 10^{{{exp}}}")
      add(_sci_to_plain(mant, exp))
  m = _POW10_RE.match(s)
  if m:
    add(_sci_to_plain("1", int(m.group(1))))
  return out


def answer_key(answer: str) -> str:
  """The form answers are compared in by maj@k and distinct-answer counts: the last of
  `answer_variants` (the most normalised), without whitespace."""
  return "".join(answer_variants(answer)[-1].split())


def _sci_to_plain(mantissa: str, exponent: int) -> str:
  """`mantissa * 10**exponent` written as an exact decimal string (bounded exponent)."""
  if abs(exponent) > 60:
    return f"{mantissa}\\times 10^{{{exponent}}}"
  value = Decimal(mantissa).scaleb(exponent)
  text = format(value.normalize(), "f")
  return text


def ground_truth_alternatives(ground_truth: Any) -> list[str]:
  """The acceptable answers listed by a ground truth.

  A list/tuple (rllm, OlympiadBench `final_answer`) lists alternatives, each a full answer. A string
  holding a `\\boxed{}` is reduced to the boxed content. Numbers are formatted with `repr`-free
  `str` (so 27.0 stays "27.0"; math-verify compares it numerically).

  Args:
    ground_truth: str, int, float, or a list/tuple of those.

  Returns:
    A non-empty list of answer strings.

  Raises:
    ValueError: on an empty ground truth or an unsupported type.
  """
  if isinstance(ground_truth, (list, tuple)):
    items = list(ground_truth)
  else:
    items = [ground_truth]
  out: list[str] = []
  for g in items:
    if isinstance(g, bool) or not isinstance(g, (str, int, float)):
      raise ValueError(f"ground_truth: unsupported element {g!r} of type {type(g).__name__}")
    g = str(g)
    boxed = extract_boxed(g) if ("\\boxed" in g or "\\fbox" in g) else None
    g = _strip_math_delims(boxed if boxed is not None else g)
    if g and g not in out:
      out.append(g)
  if not out:
    raise ValueError(f"ground_truth: no answer in {ground_truth!r}")
  return out
