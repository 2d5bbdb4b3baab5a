"""The tasks and prompt formats by name, and the one plugin loader of every workflow.

A task is registered once, by the module that defines it (`disa_jax.tasks.math`, `.code`, `.sum`):
`register_task(Task(...), reward=fn)` enters its reward and correct set in the reward registry
(`disa_jax.rewards.register_reward`: a name is a reward, a prompt record's ``ability`` and a task)
and its prompt formats here. A plugin is a module that registers more when imported, with
`register_task` or `disa_jax.rewards.register_reward` (a task without prompt formats of its own: its
prompts are veRL rows): the ``reward_plugins`` field of Stage 1, Stage 3 and evaluation configs names
them, and each of those workflows imports them with `import_reward_plugins`, here.

- `get_task(ability)`: the `Task` of a registered name; `task_names()`: the registered names.
- `prompt_format(name)`, `format_names()`, `benchmark_formats()`: the prompt-file formats
  (`disa_jax.tasks.prompts.load_prompts` reads with them) and the benchmark names they read.
- `import_reward_plugins(modules)`: imports plugin modules, a module that cannot be imported
  refused in one line naming it.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Sequence

from disa_jax import rewards
from disa_jax.tasks.base import PromptFormat, Task

__all__ = ["register_task", "register_format", "get_task", "task_names", "ground_truth_parser",
           "prompt_format", "format_names", "benchmark_formats", "import_reward_plugins"]

_TASKS: dict[str, Task] = {}  # the tasks registered with `register_task`, by name
_FORMATS: dict[str, PromptFormat] = {}  # every prompt format, in registration order


def _check_format(fmt: PromptFormat, taken: set[str]) -> None:
  """Refuses a format whose name, or one of whose benchmark names, is taken."""
  if fmt.name in _FORMATS:
    raise ValueError(f"prompt format {fmt.name!r} is already registered")
  clash = sorted(set(fmt.benchmarks) & taken)
  if clash:
    raise ValueError(f"prompt format {fmt.name!r}: benchmark(s) {clash} already have a format")


def register_format(fmt: PromptFormat) -> None:
  """Registers a prompt-file format (a task's, or veRL's, the format of every task).

  Raises:
    ValueError: when its name, or one of its benchmark names, is taken.
  """
  _check_format(fmt, set(benchmark_formats()))
  _FORMATS[fmt.name] = fmt


def register_task(task: Task, *, reward: Callable[..., Any]) -> None:
  """Registers ``task`` with its reward ``reward(responses, metas) -> Graded | [n] rewards``.

  Raises:
    ValueError: when the name, one of its formats or benchmarks is taken (nothing is registered
      then), or for a non-callable reward.
  """
  taken = set(benchmark_formats())
  for fmt in task.formats:
    _check_format(fmt, taken)
    taken |= set(fmt.benchmarks)
  rewards.register_reward(task.name, reward, correct_set=task.correct_set)
  _TASKS[task.name] = task
  for fmt in task.formats:
    register_format(fmt)


def get_task(ability: str) -> Task:
  """The task of ``ability`` (a prompt record's ``ability``, a registered reward's name).

  Raises:
    KeyError: for an unknown ability (the message names it and the known ones).
  """
  if ability not in rewards.reward_names():
    raise KeyError(f"no task is registered for ability {ability!r}; known tasks: {task_names()}")
  return _TASKS.get(ability) or Task(ability, correct_set=rewards.correct_set_of(ability))


def task_names() -> list[str]:
  """The registered tasks' names (the reward registry's), sorted."""
  return rewards.reward_names()


def ground_truth_parser(ability: str) -> Callable[[Any, str], Any] | None:
  """How a veRL row of ``ability`` has its ground truth checked (None: the default, answers)."""
  task = _TASKS.get(ability)
  return task.ground_truth if task is not None else None


def prompt_format(name: str) -> PromptFormat:
  """The prompt format ``name`` (a format's name, not a benchmark's).

  Raises:
    KeyError: for an unknown name (the message names the known ones).
  """
  if name not in _FORMATS:
    raise KeyError(f"unknown prompt format {name!r}; known: {format_names()}")
  return _FORMATS[name]


def format_names() -> tuple[str, ...]:
  """The registered prompt formats' names, in registration order."""
  return tuple(_FORMATS)


def benchmark_formats() -> dict[str, str]:
  """Benchmark name -> the prompt format it is read in."""
  return {b: f.name for f in _FORMATS.values() for b in f.benchmarks}


def import_reward_plugins(modules: Sequence[str]) -> None:
  """Imports modules that register tasks (`register_task`, or `disa_jax.rewards.register_reward`).

  Raises:
    ValueError: for a module that cannot be imported (naming it and the import error).
  """
  for m in modules:
    try:
      importlib.import_module(m)
    except ImportError as e:
      raise ValueError(f"reward_plugins: cannot import {m!r}: {e}") from e
