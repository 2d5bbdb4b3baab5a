"""Reward functions by name: `get_reward_fn(name)` is a `RewardFn` (`disa_jax.rewards.graded`):
``(responses [n], metas [n]) -> Graded`` (``[n]`` float32 rewards and ``[n]`` grading errors).

Built in:

- `'math'`: meta `{"ground_truth": str | number | list of acceptable answers}`; graded by
  `math_rewards` (time-bounded worker pool). Optional meta key `timeout_s`.
- `'code'`: the response's last fenced code block is run in the sandbox. Meta, one of
    `{"tests": [{"input": str, "output": str}, ...]}` (stdin/stdout; reward 1 iff all pass; tests
    with `"testtype": "functional"` are LiveCodeBench calls and need `"func_name"`), or
    `{"humaneval": <HumanEval+ record>}` (function calls on base + plus inputs),
  with optional `timeout_s` (per case / per HumanEval run). Candidates are graded concurrently by a
  thread pool (`code_workers`, default 2): the threads only wait on sandbox subprocesses.

Task-specific rewards are added with `register_reward(name, fn, correct_set=...)`: the tasks of
`disa_jax.tasks` register theirs when that package is imported (this package never imports it),
e.g. `'sum_task'` (`disa_jax.tasks.sum`: meta `{"ground_truth": n}`; 1 iff the token ids are
exactly one of the n + 1 canonical answers " a+b" EOS). `fn(responses, metas)` receives
`Response` objects and returns a `Graded` or an ``[n]`` array of rewards (no grading errors).

This is the one registry of tasks: a name is a reward, a prompt record's ``ability`` and a task
(`disa_jax.tasks.get_task` reads its entry). An entry holds the reward and, for a task whose
correct set can be enumerated, ``correct_set`` (``(tokenizer, reward_meta) -> every correct
response as token ids``: the exact target of `disa_jax.eval.exact`); None for the others.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from disa_jax.rewards import code as code_lib
from disa_jax.rewards import math_pool
from disa_jax.rewards.graded import Graded, Response, RewardFn

__all__ = ["Graded", "Response", "RewardFn", "register_reward", "get_reward_fn", "reward_names",
           "correct_set_of", "math_reward_fn", "code_reward_fn"]

# name -> (the grader, its correct set or None): the one registry of tasks (module docstring)
_REGISTRY: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}


def _check_lengths(responses: Sequence[Any], metas: Sequence[Mapping[str, Any]]) -> None:
  if len(responses) != len(metas):
    raise ValueError(f"responses ({len(responses)}) and metas ({len(metas)}) differ in length")


def math_reward_fn(responses: Sequence[Response], metas: Sequence[Mapping[str, Any]], *,
                   workers: int = 2) -> Graded:
  """Math reward (see module docstring).

  Args:
    responses: n responses.
    metas: n dicts with `ground_truth` (and optionally `timeout_s`, the same for the batch).
    workers: grading processes.

  Returns:
    `Graded`: ``[n]`` float32 rewards and the items whose grading failed.
  """
  _check_lengths(responses, metas)
  gts = []
  for i, m in enumerate(metas):
    if "ground_truth" not in m:
      raise ValueError(f"metas[{i}] has no 'ground_truth' (keys: {sorted(m)})")
    gts.append(m["ground_truth"])
  timeout_s = float(metas[0].get("timeout_s", math_pool.DEFAULT_TIMEOUT_S)) if metas else 1.0
  return math_pool.math_rewards([r.text for r in responses], gts, timeout_s=timeout_s,
                                workers=workers, return_errors=True)


def _code_one(response: str, meta: Mapping[str, Any]) -> float:
  program = code_lib.extract_code(response)
  if "tests" in meta:
    timeout_s = float(meta.get("timeout_s", 6.0))
    tests = meta["tests"]
    if any(t.get("testtype") == "functional" for t in tests):
      if not meta.get("func_name"):
        raise ValueError("functional tests need 'func_name' in the meta")
      results = code_lib.run_functional(program, tests, meta["func_name"], timeout_s)
    else:
      results = code_lib.run_stdio(program, tests, timeout_s)
    return 1.0 if results and all(results) else 0.0
  if "humaneval" in meta:
    timeout_s = float(meta.get("timeout_s", 30.0))
    return 1.0 if code_lib.run_humaneval(meta["humaneval"], program, timeout_s) else 0.0
  raise ValueError(f"code meta needs 'tests' or 'humaneval', got keys {sorted(meta)}")


def code_reward_fn(responses: Sequence[Response], metas: Sequence[Mapping[str, Any]], *,
                   workers: int | None = None) -> np.ndarray:
  """Code reward (see module docstring).

  Args:
    responses: n responses (a fenced code block is extracted from each).
    metas: n dicts with `tests` or `humaneval`.
    workers: concurrent sandboxes (default `min(2, os.cpu_count())`).

  Returns:
    `[n]` float32.
  """
  _check_lengths(responses, metas)
  for i, m in enumerate(metas):
    if "tests" not in m and "humaneval" not in m:
      raise ValueError(f"metas[{i}] needs 'tests' or 'humaneval' (keys: {sorted(m)})")
  workers = workers or min(2, os.cpu_count() or 1)
  texts = [r.text for r in responses]
  if workers == 1 or len(responses) <= 1:
    return np.asarray([_code_one(r, m) for r, m in zip(texts, metas)], np.float32)
  with concurrent.futures.ThreadPoolExecutor(workers) as ex:
    return np.asarray(list(ex.map(_code_one, texts, metas)), np.float32)


def register_reward(name: str, fn: Callable[..., Any], *,
                    correct_set: Callable[..., Any] | None = None, overwrite: bool = False) -> None:
  """Registers ``fn(responses: Sequence[Response], metas) -> Graded | [n] rewards`` under `name`.

  Args:
    name: the reward's (and task's, and prompt ability's) name.
    fn: the grader.
    correct_set: ``(tokenizer, reward_meta) -> [C] correct responses`` (token ids, stop token
      included) when the task's correct set can be enumerated; None when it cannot.
    overwrite: replace an entry of the same name.

  Raises:
    ValueError: when `name` is taken and `overwrite` is False, or for a non-callable.
  """
  if not isinstance(name, str) or not name:
    raise ValueError(f"reward name must be a non-empty str, got {name!r}")
  if not callable(fn):
    raise ValueError(f"reward {name!r}: fn must be callable, got {type(fn).__name__}")
  if correct_set is not None and not callable(correct_set):
    raise ValueError(f"reward {name!r}: correct_set must be callable or None, got "
                     f"{type(correct_set).__name__}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"reward {name!r} is already registered")
  _REGISTRY[name] = (fn, correct_set)


def _entry(name: str) -> tuple[Callable[..., Any], Callable[..., Any] | None]:
  if name not in _REGISTRY:
    raise KeyError(f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name]


def correct_set_of(name: str) -> Callable[..., Any] | None:
  """The correct-set function registered with reward `name` (None: not enumerable).

  Raises:
    KeyError: for an unknown name (the message lists the known ones).
  """
  return _entry(name)[1]


def _as_response(r: Any, i: int) -> Response:
  if isinstance(r, Response):
    return r
  if isinstance(r, str):
    return Response(r)
  raise ValueError(f"responses[{i}] must be a Response or a str, got {type(r).__name__}: {r!r}")


def get_reward_fn(name: str) -> RewardFn:
  """The reward function registered as `name`, as a `RewardFn`.

  The returned function accepts `Response` objects (or plain strings, taken as the text) and checks
  that the grader returned one finite reward per response. Graders that detect failed gradings
  return them in `Graded.error` and warn (`graded.warn_on_errors`).

  Raises:
    KeyError: for an unknown name (the message lists the known ones).
  """
  fn = _entry(name)[0]

  def wrapped(responses: Sequence[Any], metas: Sequence[Mapping[str, Any]]) -> Graded:
    _check_lengths(responses, metas)
    out = fn([_as_response(r, i) for i, r in enumerate(responses)], metas)
    graded = out if isinstance(out, Graded) else Graded.ok(out)
    if graded.reward.shape != (len(responses),):
      raise ValueError(f"reward {name!r} returned shape {graded.reward.shape}, expected "
                       f"({len(responses)},)")
    bad = np.flatnonzero(~np.isfinite(graded.reward))
    if bad.size:
      raise ValueError(f"reward {name!r} returned {bad.size} non-finite reward(s) at response "
                       f"index(es) {bad[:10].tolist()}: {graded.reward[bad[:10]].tolist()}")
    return graded

  wrapped.__name__ = f"reward_{name}"
  return wrapped


def reward_names() -> list[str]:
  return sorted(_REGISTRY)


register_reward("math", math_reward_fn)
register_reward("code", code_reward_fn)
