"""The tasks by name, and the one plugin loader of every workflow.

A task is registered once, with its reward (`disa_jax.rewards.register_reward(name, fn,
correct_set=...)`, the one registry of tasks: a name is a reward, a prompt record's ``ability`` and
a task). The built-in tasks: 'math' and 'code' (`disa_jax.rewards`), 'sum_task'
(`disa_jax.tasks.sum`, registered when `disa_jax.tasks` is imported). A plugin is a module that
registers more when imported: the ``reward_plugins`` field of Stage 1, Stage 3 and evaluation
configs names them, and each of those workflows imports them with `import_reward_plugins`, here.

- `get_task(ability)`: the `Task` of a registered name; `task_names()`: the registered names.
- `import_reward_plugins(modules)`: imports plugin modules, a module that cannot be imported
  refused in one line naming it.
"""
from __future__ import annotations

import importlib
from typing import Sequence

from disa_jax import rewards
from disa_jax.tasks.base import Task

__all__ = ["get_task", "import_reward_plugins", "task_names"]


def get_task(ability: str) -> Task:
  """The task of ``ability`` (a prompt record's ``ability``, a registered reward's name).

  Raises:
    KeyError: for an unknown ability (the message names it and the known ones).
  """
  if ability not in rewards.reward_names():
    raise KeyError(f"no task is registered for ability {ability!r}; known tasks: {task_names()}")
  return Task(ability, correct_set=rewards.correct_set_of(ability))


def task_names() -> list[str]:
  """The registered tasks' names (the reward registry's), sorted."""
  return rewards.reward_names()


def import_reward_plugins(modules: Sequence[str]) -> None:
  """Imports modules that register tasks (`disa_jax.rewards.register_reward`: rewards by name).

  Raises:
    ValueError: for a module that cannot be imported (naming it and the import error).
  """
  for m in modules:
    try:
      importlib.import_module(m)
    except ImportError as e:
      raise ValueError(f"reward_plugins: cannot import {m!r}: {e}") from e
