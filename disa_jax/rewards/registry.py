"""Reward functions by name: `get_reward_fn(name)` is a `RewardFn` (`disa_jax.rewards.graded`):
``(responses [n], metas [n]) -> Graded`` (``[n]`` float32 rewards and ``[n]`` grading errors).

Rewards are registered with `register_reward(name, fn, correct_set=...)`: each task of
`disa_jax.tasks` registers its own when that package is imported (this package never imports it):
'math' (`disa_jax.tasks.math`, graded by `math_rewards`), 'code' (`disa_jax.tasks.code`, run in the
sandbox of `disa_jax.rewards.code`), 'sum_task' (`disa_jax.tasks.sum`). A plugin module may call it
too. `fn(responses, metas)` receives `Response` objects and returns a `Graded` or an ``[n]`` array
of rewards (no grading errors).

This is the one registry of rewards: a name is a reward, a prompt record's ``ability`` and a task
(`disa_jax.tasks.get_task` reads its entry). An entry holds the reward and, for a task whose
correct set can be enumerated, ``correct_set`` (``(tokenizer, reward_meta) -> every correct
response as token ids``: the exact target of `disa_jax.eval.exact`); None for the others.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from disa_jax.rewards.graded import Graded, Response, RewardFn

__all__ = ["Graded", "Response", "RewardFn", "register_reward", "get_reward_fn", "reward_names",
           "correct_set_of", "check_lengths"]

# name -> (the grader, its correct set or None): the one registry of tasks (module docstring)
_REGISTRY: dict[str, tuple[Callable[..., Any], Callable[..., Any] | None]] = {}


def check_lengths(responses: Sequence[Any], metas: Sequence[Mapping[str, Any]]) -> None:
  """Refuses responses and metas of different lengths (naming both)."""
  if len(responses) != len(metas):
    raise ValueError(f"responses ({len(responses)}) and metas ({len(metas)}) differ in length")


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
    check_lengths(responses, metas)
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

