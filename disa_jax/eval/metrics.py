"""Evaluation metrics of the paper (§3.1): Mean@k, unbiased pass@k, maj@k, and result tables.

- `mean_at_k(correct [P, k])`: the mean correctness over all P*k samples (the paper's Mean@8).
- `pass_at_k(n, c, k)`: the unbiased estimator 1 - C(n-c, k) / C(n, k) for one problem with n
  samples of which c are correct (Chen et al., 2021), computed as a stable product;
  `pass_at_k_from_correct(correct [P, n], k)` averages it over problems.
- `maj_at_k(answers [P][k], correct [P, k])`: correctness of the majority-vote answer per problem.
- `markdown_table(results)` / `write_results(results, md_path, json_path)`: per-benchmark and
  average tables, results given as `{method: {benchmark: value}}`.
"""

from __future__ import annotations

import collections
import json
import math
from typing import Hashable, Mapping, Sequence

import numpy as np

__all__ = ["mean_at_k", "pass_at_k", "pass_at_k_from_correct", "maj_at_k", "markdown_table",
           "results_json", "write_results"]


def _as_2d_bool(correct, name: str = "correct") -> np.ndarray:
  arr = np.asarray(correct)
  if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
    raise ValueError(f"{name} must be a non-empty [P, k] array, got shape {arr.shape}")
  if arr.dtype != bool:
    if not np.all((arr == 0) | (arr == 1)):
      raise ValueError(f"{name} must hold 0/1 or bool values")
    arr = arr.astype(bool)
  return arr


def mean_at_k(correct) -> float:
  """Mean@k: average correctness over the k samples of every problem.

  Args:
    correct: `[P, k]` bool or 0/1.

  Returns:
    The mean in [0, 1].
  """
  return float(_as_2d_bool(correct).mean())


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k for one problem: 1 - C(n-c, k) / C(n, k).

  Args:
    n: samples drawn.
    c: correct samples among them.
    k: the k of pass@k (k <= n).

  Returns:
    The estimate in [0, 1].

  Raises:
    ValueError: unless 0 <= c <= n and 1 <= k <= n.
  """
  if not (isinstance(n, (int, np.integer)) and isinstance(c, (int, np.integer))
          and isinstance(k, (int, np.integer))):
    raise ValueError(f"n, c, k must be ints, got {n!r}, {c!r}, {k!r}")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n, got c={c}, n={n}")
  if n - c < k:
    return 1.0
  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_from_correct(correct, k: int) -> float:
  """Mean over problems of `pass_at_k(n, c_p, k)`.

  Args:
    correct: `[P, n]` bool or 0/1.
    k: the k (<= n).

  Returns:
    The mean estimate in [0, 1].
  """
  arr = _as_2d_bool(correct)
  n = arr.shape[1]
  return float(np.mean([pass_at_k(n, int(c), k) for c in arr.sum(axis=1)]))


def maj_at_k(answers: Sequence[Sequence[Hashable | None]], correct, k: int | None = None) -> float:
  """maj@k: fraction of problems whose most frequent answer among the first k samples is correct.

  Samples without an answer (None) do not vote; a problem with no answer at all scores 0. Ties are
  broken by the earliest sample. The majority answer is correct when the sample carrying it is
  (samples with equal answers are graded equally).

  Args:
    answers: `[P][n]` answer keys (normalised answer strings, or None).
    correct: `[P, n]` bool or 0/1, the grade of each sample.
    k: use the first k samples (default: all n).

  Returns:
    The fraction in [0, 1].
  """
  arr = _as_2d_bool(correct)
  if len(answers) != arr.shape[0]:
    raise ValueError(f"answers has {len(answers)} problems, correct has {arr.shape[0]}")
  k = arr.shape[1] if k is None else k
  if not 1 <= k <= arr.shape[1]:
    raise ValueError(f"maj_at_k needs 1 <= k <= {arr.shape[1]}, got {k}")
  score = 0.0
  for p, row in enumerate(answers):
    if len(row) != arr.shape[1]:
      raise ValueError(f"answers[{p}] has {len(row)} samples, expected {arr.shape[1]}")
    counts = collections.Counter(a for a in row[:k] if a is not None)
    if not counts:
      continue
    top = max(counts.values())
    first = next(i for i, a in enumerate(row[:k]) if a is not None and counts[a] == top)
    score += float(arr[p, first])
  return score / len(answers)


def _fmt(v: float | None, scale: float, precision: int) -> str:
  if v is None or (isinstance(v, float) and math.isnan(v)):
    return "-"
  return f"{v * scale:.{precision}f}"


def markdown_table(results: Mapping[str, Mapping[str, float]], benchmarks: Sequence[str] | None
                   = None, *, average: bool = True, scale: float = 100.0, precision: int = 1,
                   bold_best: bool = True) -> str:
  """A markdown table with one row per method and one column per benchmark (+ Average).

  Args:
    results: `{method: {benchmark: value in [0, 1]}}`.
    benchmarks: column order (default: first-seen order over all methods).
    average: add an Average column (mean over the benchmarks the method has).
    scale: multiply values (100 for percentages).
    precision: decimals.
    bold_best: bold the best value of every column.

  Returns:
    The table text.
  """
  if not results:
    raise ValueError("results is empty")
  if benchmarks is None:
    benchmarks = list(dict.fromkeys(b for m in results.values() for b in m))
  cols = list(benchmarks) + (["Average"] if average else [])
  table = {}
  for method, vals in results.items():
    row = {b: vals.get(b) for b in benchmarks}
    if average:
      present = [v for v in row.values() if v is not None]
      row["Average"] = float(np.mean(present)) if present else None
    table[method] = row
  best = {c: max((r[c] for r in table.values() if r[c] is not None), default=None) for c in cols}
  lines = ["| Method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
  for method, row in table.items():
    cells = []
    for c in cols:
      s = _fmt(row[c], scale, precision)
      if bold_best and row[c] is not None and best[c] is not None and row[c] == best[c] and \
          len(table) > 1:
        s = f"**{s}**"
      cells.append(s)
    lines.append(f"| {method} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def results_json(results: Mapping[str, Mapping[str, float]]) -> dict:
  """`{method: {benchmark: value, ..., "average": mean}}` (JSON-serialisable floats)."""
  out = {}
  for method, vals in results.items():
    row = {b: float(v) for b, v in vals.items()}
    row["average"] = float(np.mean(list(row.values()))) if row else float("nan")
    out[method] = row
  return out


def write_results(results: Mapping[str, Mapping[str, float]], md_path: str | None = None,
                  json_path: str | None = None, **table_kwargs) -> None:
  """Writes the markdown table and/or the JSON form of `results`."""
  if md_path:
    with open(md_path, "w") as f:
      f.write(markdown_table(results, **table_kwargs))
  if json_path:
    with open(json_path, "w") as f:
      json.dump(results_json(results), f, indent=2, sort_keys=True)
