"""Diversity of k responses to one problem: the LLM judge of App. D.5 and a local, offline metric.

Judge. `DiversityJudge(url, model, api_key)` sends the App. D.5 prompt (the FlowRL diversity-judge
prompt the paper reproduces; the paper's judge is GPT-4o-mini) to an OpenAI-compatible
chat-completions endpoint, retries transient failures with capped exponential back-off, caches every
answer on disk (keyed by the whole request body: model, messages, decoding settings and any extra
fields), and returns the integer score 1..5. An endpoint that stays unreachable raises
`JudgeUnavailableError` naming the URL, the number of attempts and the last error. `extra_body`
adds provider-specific fields to the request, e.g. vLLM's
``{"structured_outputs": {"choice": ["1", "2", "3", "4", "5"]}}`` to constrain an open judge model
served with ``vllm serve`` to the answer format (tests/eval/test_diversity_vllm.py runs this
against a real vLLM server).

Requests go through the maintained `openai` client (the 'openai' extra; the same client as the
served-model engine, `disa_jax.rollout.openai_engine.openai_client`): timeouts, connection pooling
and the wire format are its. The retry policy is the judge's own, because a reply without a
parseable score must be retried like a transport error or an HTTP 408/429/5xx (the client retries
only the latter): the client runs with no retries of its own, and every HTTP request it sends is
counted (`num_requests`, so a cache hit is checkable).

The prompt is transcribed from the paper's LaTeX: math-mode numbers become plain digits and the
typeset dashes become "-"; `{n}` is the number of responses (8 in the paper) and the responses are
formatted as "Response i:" blocks separated by blank lines.

Local metric (no network, no download). `local_diversity(responses)` gives the number of distinct
final answers (boxed answers, normalised strings) and the mean pairwise cosine distance of response
embeddings. The embedding is pluggable (`embed_fn: list[str] -> [k, D] array`); the default is a
character n-gram TF-IDF vector fitted on the k responses themselves (`char_ngram_tfidf`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from typing import Callable, Sequence

import numpy as np

from disa_jax.rewards import math_answer
from disa_jax.rollout.openai_engine import openai_client

__all__ = [
  "JUDGE_SYSTEM_PROMPT",
  "JUDGE_USER_TEMPLATE",
  "judge_messages",
  "parse_judge_score",
  "JudgeUnavailableError",
  "Retry",
  "DiversityJudge",
  "char_ngram_tfidf",
  "mean_pairwise_distance",
  "distinct_answers",
  "local_diversity",
]

JUDGE_SYSTEM_PROMPT = (
  "You are evaluating the DIVERSITY of solution approaches for a mathematics competition problem. "
  "Focus on detecting even SUBTLE differences in methodology that indicate different "
  "problem-solving strategies.")

JUDGE_USER_TEMPLATE = (
  "PROBLEM: {problem}.\n"
  "{n} SOLUTION ATTEMPTS: {formatted_responses}.\n"
  "\n"
  "Evaluation criteria. Rate diversity from 1 to 5:\n"
  "Score 1 - Minimal Diversity: 14+ responses use essentially identical approaches; same "
  "mathematical setup, same variable choices, same solution path; only trivial differences "
  "(arithmetic, notation, wording); indicates very low exploration/diversity in the generation "
  "process.\n"
  "Score 2 - Low Diversity: 11-13 responses use the same main approach; 1-2 alternative approaches "
  "appear but are rare; minor variations within the dominant method (different substitutions, "
  "orderings); some exploration but heavily biased toward one strategy.\n"
  "Score 3 - Moderate Diversity: 7-10 responses use the most common approach; 2-3 distinct "
  "alternative approaches present; noticeable variation in problem setup or mathematical "
  "techniques; balanced mix showing reasonable exploration.\n"
  "Score 4 - High Diversity: 4-6 responses use the most common approach; 3-4 distinct solution "
  "strategies well-represented; multiple mathematical techniques and problem framings; strong "
  "evidence of diverse exploration strategies.\n"
  "Score 5 - Maximum Diversity: no single approach dominates (<= 3 responses use the same method); "
  "4+ distinctly different solution strategies; wide variety of mathematical techniques and "
  "creative approaches; excellent exploration and generation diversity.\n"
  "\n"
  "IMPORTANT: focus on the DIVERSITY of the attempted approaches. Return ONLY a number from 1 to "
  "5.")


def _format_responses(responses: Sequence[str]) -> str:
  return "".join(f"\n\nResponse {i + 1}:\n{r.strip()}" for i, r in enumerate(responses))


def judge_messages(problem: str, responses: Sequence[str]) -> list[dict[str, str]]:
  """The chat messages of App. D.5 for one problem and its responses."""
  if not responses:
    raise ValueError("responses is empty")
  user = JUDGE_USER_TEMPLATE.format(problem=problem.strip(), n=len(responses),
                                    formatted_responses=_format_responses(responses))
  return [{"role": "system", "content": JUDGE_SYSTEM_PROMPT}, {"role": "user", "content": user}]


def parse_judge_score(text: str) -> int | None:
  """The first integer 1..5 standing alone in the judge's reply, or None."""
  m = re.search(r"(?<![\d.])([1-5])(?![\d.])", text)
  return int(m.group(1)) if m else None


class JudgeUnavailableError(RuntimeError):
  """The judge endpoint could not be reached or kept failing."""


@dataclasses.dataclass(frozen=True)
class Retry:
  """The judge's retry policy (for connection errors, timeouts, HTTP 408/429/5xx and unparseable
  replies).

  Attributes:
    max_retries: attempts after the first one.
    backoff_s: first retry delay (doubles each retry).
    max_backoff_s: cap on one retry delay (None: no cap).
    timeout_s: per-request timeout.
  """
  max_retries: int = 3
  backoff_s: float = 1.0
  max_backoff_s: float | None = None
  timeout_s: float = 60.0

  def __post_init__(self):
    if self.max_retries < 0:
      raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
    if self.max_backoff_s is not None and self.max_backoff_s < 0:
      raise ValueError(f"max_backoff_s must be None or >= 0, got {self.max_backoff_s}")

  def delay(self, attempt: int) -> float:
    """Seconds to wait before retry ``attempt`` (>= 1)."""
    d = self.backoff_s * 2 ** (attempt - 1)
    return d if self.max_backoff_s is None else min(d, self.max_backoff_s)


class DiversityJudge:
  """OpenAI-compatible LLM judge with retries and an on-disk cache.

  Args:
    url: the endpoint: a base URL (e.g. `https://api.openai.com/v1`), to which
      `/chat/completions` is appended, or the full `.../chat/completions` URL.
    model: the judge model name (the paper: gpt-4o-mini).
    api_key: sent as `Authorization: Bearer <key>` (none given: ``$OPENAI_API_KEY`` if set, else
      the placeholder 'EMPTY').
    cache_dir: directory of cached answers (None: no cache).
    retry: the retry policy and per-request timeout (`Retry`).
    temperature: sampling temperature sent to the judge.
    max_tokens: completion budget of the reply.
    extra_body: further JSON fields merged into every request (they may not override ``model``,
      ``messages``, ``temperature`` or ``max_tokens``); part of the cache key.
  """

  def __init__(self, url: str, model: str, api_key: str | None = None, *,
               cache_dir: str | None = None, retry: Retry = Retry(), temperature: float = 0.0,
               max_tokens: int = 16, extra_body: dict | None = None):
    if not url.startswith(("http://", "https://")):
      raise ValueError(f"url must start with http:// or https://, got {url!r}")
    if not model:
      raise ValueError("model must be a non-empty string")
    clash = sorted(set(extra_body or {}) & {"model", "messages", "temperature", "max_tokens"})
    if clash:
      raise ValueError(f"extra_body may not set {clash}; use the DiversityJudge arguments")
    url = url.rstrip("/")
    self.endpoint = url if url.endswith("/chat/completions") else url + "/chat/completions"
    self.model = model
    self._client = openai_client(self.endpoint.removesuffix("/chat/completions"), api_key or "",
                                 timeout_s=retry.timeout_s, max_retries=0,
                                 on_request=self._count)
    self.cache_dir, self.retry = cache_dir, retry
    self.temperature = temperature
    self.max_tokens = max_tokens
    self.extra_body = dict(extra_body or {})
    self.num_requests = 0  # HTTP requests actually sent (cache hits send none)

  def _cache_path(self, body: dict) -> str | None:
    if not self.cache_dir:
      return None
    key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return os.path.join(self.cache_dir, key + ".json")

  def _count(self, request) -> None:
    del request
    self.num_requests += 1

  def _post(self, body: dict) -> str:
    known = {k: body[k] for k in ("model", "messages", "temperature", "max_tokens")}
    extra = {k: v for k, v in body.items() if k not in known}
    reply = self._client.chat.completions.create(**known, extra_body=extra or None)
    try:
      content = reply.choices[0].message.content
    except (AttributeError, IndexError, TypeError) as e:
      raise ValueError(f"malformed chat-completions reply: {str(reply)[:200]}") from e
    if content is None:
      raise ValueError(f"chat-completions reply without content: {str(reply)[:200]}")
    return str(content)

  def score(self, problem: str, responses: Sequence[str]) -> int:
    """The judge's diversity score (1..5) for `responses` to `problem`.

    Raises:
      JudgeUnavailableError: the endpoint is unreachable, keeps failing, or never returns a score.
    """
    import openai  # pylint: disable=g-import-not-at-top  (optional: the 'openai' extra)
    body = {"model": self.model, "messages": judge_messages(problem, responses),
            "temperature": self.temperature, "max_tokens": self.max_tokens, **self.extra_body}
    path = self._cache_path(body)
    if path and os.path.exists(path):
      with open(path) as f:
        return int(json.load(f)["score"])
    last_err: Exception | None = None
    for attempt in range(self.retry.max_retries + 1):
      if attempt:
        time.sleep(self.retry.delay(attempt))
      try:
        text = self._post(body)
      except openai.APIStatusError as e:
        last_err = e
        if e.status_code in (408, 429) or e.status_code >= 500:
          continue
        raise JudgeUnavailableError(
          f"diversity judge at {self.endpoint} rejected the request: HTTP {e.status_code} "
          f"{str(e.body)[:500]}") from e
      except (openai.APIConnectionError, ValueError) as e:  # incl. APITimeoutError
        last_err = e
        continue
      s = parse_judge_score(text)
      if s is None:
        last_err = ValueError(f"no score 1..5 in the judge's reply {text[:200]!r}")
        continue
      if path:
        os.makedirs(self.cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
          json.dump({"score": s, "reply": text, "model": self.model}, f)
        os.replace(tmp, path)
      return s
    raise JudgeUnavailableError(f"diversity judge at {self.endpoint} failed after "
                                f"{self.retry.max_retries + 1} attempts: {last_err!r}")

  def score_many(self, problems: Sequence[str], responses: Sequence[Sequence[str]]) -> np.ndarray:
    """Scores for P problems: `[P]` int array."""
    if len(problems) != len(responses):
      raise ValueError(f"{len(problems)} problems but {len(responses)} response lists")
    return np.asarray([self.score(p, r) for p, r in zip(problems, responses)], np.int32)


# ----------------------------------------------------------------------------------------------
# Local metric.
# ----------------------------------------------------------------------------------------------


def char_ngram_tfidf(texts: Sequence[str], ngram_range: tuple[int, int] = (3, 5),
                     max_chars: int = 20000) -> np.ndarray:
  """L2-normalised character n-gram TF-IDF vectors, fitted on `texts` themselves.

  Whitespace runs are collapsed and text is lower-cased; each text is cut to `max_chars`.
  IDF = log((1 + k) / (1 + df)) + 1 (smoothed); TF = raw counts.

  Args:
    texts: k strings.
    ngram_range: inclusive n-gram lengths.
    max_chars: characters of each text used.

  Returns:
    `[k, V]` float32 rows of unit norm (zero rows for empty texts), V = distinct n-grams.
  """
  lo, hi = ngram_range
  if not 1 <= lo <= hi:
    raise ValueError(f"ngram_range must satisfy 1 <= lo <= hi, got {ngram_range}")
  docs = []
  for t in texts:
    t = re.sub(r"\s+", " ", t.lower())[:max_chars]
    counts: dict[str, int] = {}
    for n in range(lo, hi + 1):
      for i in range(len(t) - n + 1):
        g = t[i:i + n]
        counts[g] = counts.get(g, 0) + 1
    docs.append(counts)
  vocab: dict[str, int] = {}
  for d in docs:
    for g in d:
      vocab.setdefault(g, len(vocab))
  mat = np.zeros((len(texts), max(1, len(vocab))), np.float32)
  for r, d in enumerate(docs):
    if d:
      idx = np.fromiter((vocab[g] for g in d), np.int64, len(d))
      mat[r, idx] = np.fromiter(d.values(), np.float32, len(d))
  df = (mat > 0).sum(axis=0)
  idf = np.log((1.0 + len(texts)) / (1.0 + df)) + 1.0
  mat *= idf[None, :].astype(np.float32)
  norms = np.linalg.norm(mat, axis=1, keepdims=True)
  return np.where(norms > 0, mat / np.maximum(norms, 1e-12), 0.0).astype(np.float32)


def mean_pairwise_distance(responses: Sequence[str],
                           embed_fn: Callable[[Sequence[str]], np.ndarray] = char_ngram_tfidf
                           ) -> float:
  """Mean cosine distance 1 - cos(e_i, e_j) over pairs i < j of the responses' embeddings.

  Args:
    responses: k >= 2 strings.
    embed_fn: `list[str] -> [k, D]` embeddings (need not be normalised).

  Returns:
    The mean distance (0 for identical texts; at most 2).
  """
  if len(responses) < 2:
    raise ValueError(f"need at least 2 responses, got {len(responses)}")
  emb = np.asarray(embed_fn(list(responses)), np.float64)
  if emb.ndim != 2 or emb.shape[0] != len(responses):
    raise ValueError(f"embed_fn returned shape {emb.shape}, expected [{len(responses)}, D]")
  norms = np.linalg.norm(emb, axis=1, keepdims=True)
  unit = np.where(norms > 0, emb / np.maximum(norms, 1e-12), 0.0)
  sim = np.einsum("id,jd->ij", unit, unit)
  iu = np.triu_indices(len(responses), k=1)
  return float(np.mean(1.0 - sim[iu]))


def distinct_answers(responses: Sequence[str]) -> int:
  """Number of distinct final answers (normalised strings) among responses that state one."""
  keys = set()
  for r in responses:
    a = math_answer.extract_final_answer(r)
    if a is not None:
      keys.add(math_answer.answer_key(a))
  return len(keys)


def local_diversity(responses: Sequence[str],
                    embed_fn: Callable[[Sequence[str]], np.ndarray] = char_ngram_tfidf
                    ) -> dict[str, float]:
  """`{"distinct_answers": int, "mean_pairwise_distance": float}` for k >= 2 responses."""
  return {"distinct_answers": float(distinct_answers(responses)),
          "mean_pairwise_distance": mean_pairwise_distance(responses, embed_fn)}
