"""Benchmark runner: sample k responses per prompt with an `Engine`, grade them, report metrics.

The paper's protocol (App. D.1, table "Shared RL training and evaluation configuration"):
temperature 0.6, top-p 0.95, Mean@8 for math (math-verify on the boxed final answer), pass@1 and
pass@16 for code (execution). `eval_sampling_params(k, max_tokens, eos_id)` builds those settings;
`evaluate_benchmark(engine, tokenizer, records, params)` runs one benchmark and returns a
`BenchmarkResult` (its two halves: `sample_and_grade` of a slice of the records into `GradedRow`s,
which the evaluation command saves slice by slice so that a preempted run resumes, and
`result_from_rows`) (the `[P, k]` correctness matrix, the responses, the extracted answers and the
metrics); `evaluate_suite` runs several and `suite_table` turns them into the markdown table with an
average column.

Metrics per benchmark: `pass@1`, `pass@k` (unbiased estimator) and `distinct_correct@k` (distinct
correct response texts per problem) for every ability; `mean@k` for all but code; `maj@k` for math.
The grading-error share of the reward function is reported as `grade_error_share`. The engine is any
object with `generate(prompt_token_ids, params)` as in `disa_jax.rollout.Engine`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.records import PromptRecord
from disa_jax.eval import metrics
from disa_jax.rewards import math_answer
from disa_jax.rewards import registry
from disa_jax.rewards.graded import Response
from disa_jax.rollout.types import SamplingParams

__all__ = ["BenchmarkResult", "GradedRow", "benchmark_ability", "eval_sampling_params",
           "evaluate_benchmark", "evaluate_suite", "result_from_rows", "sample_and_grade",
           "suite_table"]


@dataclasses.dataclass
class BenchmarkResult:
  """Outcome of one benchmark.

  Attributes:
    name: benchmark name.
    ability: 'math' or 'code'.
    prompt_ids: `[P]` record ids.
    correct: `[P, k]` bool.
    responses: `[P][k]` decoded responses.
    answers: `[P][k]` normalised final answers (math; None where there is none), else None.
    metrics: metric name -> value.
    prompt_token_ids: `[P]` the prompts' token ids as the engine saw them.
  """
  name: str
  ability: str
  metrics: dict[str, float]
  prompt_ids: list[str] = codec.field(rows="per_prompt", key="prompt_id")
  correct: np.ndarray = codec.field(rows="per_prompt", dtype=int)
  responses: list[list[str]] = codec.field(stored=False)
  answers: list[list[str | None]] | None = codec.field(stored=False)
  prompt_token_ids: list[tuple[int, ...]] = codec.field(stored=False, default_factory=list)


def eval_sampling_params(k: int, max_tokens: int, eos_id: int | None, *, seed: int = 0,
                         temperature: float = 0.6, top_p: float = 0.95) -> SamplingParams:
  """The paper's evaluation sampling: k samples at temperature 0.6, top-p 0.95."""
  stop = () if eos_id is None else (int(eos_id),)
  return SamplingParams(n=k, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                        stop_token_ids=stop, seed=seed)


def _answer_key(text: str) -> str | None:
  ans = math_answer.extract_final_answer(text)
  if ans is None or len(ans) > 1000:
    return None
  return math_answer.answer_key(ans)


def _distinct_correct(responses: Sequence[Sequence[str]], correct: np.ndarray) -> float:
  """Mean over problems of the number of distinct correct responses (whitespace-normalised)."""
  return float(np.mean([len({" ".join(r.split()) for r, ok in zip(row, cr) if ok})
                        for row, cr in zip(responses, correct)]))


@dataclasses.dataclass(frozen=True)
class GradedRow:
  """One problem's k responses, graded (a row of evaluation's ``<name>_responses.jsonl``).

  Attributes:
    prompt_id: the record's id.
    responses: ``[k]`` decoded responses.
    correct: ``[k]`` graded correct.
    grade_errors: how many of the k the grader failed on (scored 0).
  """
  prompt_id: str
  responses: tuple[str, ...]
  correct: tuple[bool, ...]
  grade_errors: int


def benchmark_ability(records: Sequence[PromptRecord], name: str) -> str:
  """The one ability of a benchmark's records (refused: none, or several)."""
  if not records:
    raise ValueError(f"{name}: no records")
  abilities = {r.ability for r in records}
  if len(abilities) != 1:
    raise ValueError(f"{name}: records mix abilities {sorted(abilities)}")
  return abilities.pop()


def sample_and_grade(engine: Any, tokenizer: Any, records: Sequence[PromptRecord],
                     prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams, *,
                     name: str, reward_fn_name: str) -> list[GradedRow]:
  """`params.n` responses per record (one engine call), decoded and graded by ``reward_fn_name``.

  A slice of a benchmark draws the samples that the whole benchmark's call would when
  ``params.prompt_index_offset`` is the slice's start (`SamplingParams`).
  """
  k = params.n
  completions = engine.generate([list(p) for p in prompt_token_ids], params)
  if len(completions) != len(records) or any(len(c) != k for c in completions):
    raise ValueError(f"{name}: engine returned {[len(c) for c in completions]} completions for "
                     f"{len(records)} prompts x n={k}")
  responses = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in row]
               for row in completions]
  flat = [Response(t, tuple(int(x) for x in c.token_ids), c.finish_reason)
          for row, texts in zip(completions, responses) for c, t in zip(row, texts)]
  flat_meta = [rec.reward_meta() for rec in records for _ in range(k)]
  graded = registry.get_reward_fn(reward_fn_name)(flat, flat_meta)
  correct = graded.reward.reshape(len(records), k) > 0.5  # [P*k] -> [P, k], prompt-major
  errors = graded.error.reshape(len(records), k).sum(axis=1)  # [P]
  return [GradedRow(r.prompt_id, tuple(texts), tuple(bool(c) for c in ok), int(e))
          for r, texts, ok, e in zip(records, responses, correct, errors)]


def result_from_rows(name: str, ability: str, rows: Sequence[GradedRow],
                     prompt_token_ids: Sequence[tuple[int, ...]], *,
                     pass_ks: Sequence[int] | None = None) -> BenchmarkResult:
  """The benchmark's metrics from its graded rows (all of them, in record order)."""
  k = len(rows[0].correct)
  correct = np.array([r.correct for r in rows], bool)  # [P, k]
  responses = [list(r.responses) for r in rows]
  result_metrics: dict[str, float] = {}
  answers = None
  for kk in sorted(set(pass_ks if pass_ks is not None else (1, k))):
    result_metrics[f"pass@{kk}"] = metrics.pass_at_k_from_correct(correct, kk)
  if ability != "code":
    result_metrics[f"mean@{k}"] = metrics.mean_at_k(correct)
  if ability == "math":
    answers = [[_answer_key(r) for r in row] for row in responses]
    result_metrics[f"maj@{k}"] = metrics.maj_at_k(answers, correct)
  result_metrics[f"distinct_correct@{k}"] = _distinct_correct(responses, correct)
  result_metrics["grade_error_share"] = float(sum(r.grade_errors for r in rows) / correct.size)
  return BenchmarkResult(name=name, ability=ability, metrics=result_metrics,
                         prompt_ids=[r.prompt_id for r in rows], correct=correct,
                         responses=responses, answers=answers,
                         prompt_token_ids=list(prompt_token_ids))


def evaluate_benchmark(engine: Any, tokenizer: Any, records: Sequence[PromptRecord],
                       params: SamplingParams, *, name: str = "benchmark",
                       rendering: str = "chat_template", max_prompt_len: int = 4096,
                       pass_ks: Sequence[int] | None = None,
                       reward_fn_name: str | None = None) -> BenchmarkResult:
  """Samples `params.n` responses per record, grades them, computes the metrics.

  Args:
    engine: an `Engine` (`generate(prompt_token_ids, params) -> [P][n] Completion`).
    tokenizer: the policy's tokenizer (chat template, encode/decode).
    records: the benchmark's prompts (one ability for all).
    params: sampling parameters; `params.n` is the k of the metrics.
    name: benchmark name in the result.
    rendering: prompt rendering (`disa_jax.data.prompting`).
    max_prompt_len: the longest prompt allowed (tokens).
    pass_ks: the k's of pass@k (default: 1 and n).
    reward_fn_name: registry name (default: the records' ability).

  Returns:
    The `BenchmarkResult`.
  """
  ability = benchmark_ability(records, name)
  prompt_ids = [encode_prompt(tokenizer, r, rendering, max_len=max_prompt_len) for r in records]
  rows = sample_and_grade(engine, tokenizer, records, prompt_ids, params, name=name,
                          reward_fn_name=reward_fn_name or ability)
  return result_from_rows(name, ability, rows, prompt_ids, pass_ks=pass_ks)


def evaluate_suite(engine: Any, tokenizer: Any, benchmarks: Mapping[str, Sequence[PromptRecord]],
                   params: SamplingParams, **kwargs) -> dict[str, BenchmarkResult]:
  """`evaluate_benchmark` over `{name: records}`; same sampling for all."""
  return {name: evaluate_benchmark(engine, tokenizer, recs, params, name=name, **kwargs)
          for name, recs in benchmarks.items()}


def suite_table(results_by_method: Mapping[str, Mapping[str, BenchmarkResult]], metric: str,
                *, json_path: str | None = None, md_path: str | None = None) -> str:
  """Markdown table of `metric` (e.g. 'mean@8', 'pass@16') per method and benchmark, with Average.

  Args:
    results_by_method: `{method: {benchmark: BenchmarkResult}}`.
    metric: a key of `BenchmarkResult.metrics`.
    json_path: also write the values (and per-prompt correctness) as JSON.
    md_path: also write the table.

  Returns:
    The markdown table.
  """
  values = {}
  for method, res in results_by_method.items():
    row = {}
    for bench, r in res.items():
      if metric not in r.metrics:
        raise KeyError(f"{method}/{bench}: no metric {metric!r} (has {sorted(r.metrics)})")
      row[bench] = r.metrics[metric]
    values[method] = row
  table = metrics.markdown_table(values)
  if md_path:
    with open(md_path, "w") as f:
      f.write(table)
  if json_path:
    with open(json_path, "w") as f:
      json.dump({"metric": metric, "results": metrics.results_json(values),
                 "details": {m: {b: codec.encode(r) for b, r in res.items()}
                             for m, res in results_by_method.items()}}, f, indent=1)
  return table
