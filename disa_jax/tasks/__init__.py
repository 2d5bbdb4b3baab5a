"""Tasks: each ability's reward and optional exact target, behind one registry.

- `base`: `Task` (name = reward name = prompt ability; `reward_fn`, `correct_set`, `measures`),
  `register_task`, `get_task(ability)`, `task_names()`.
- `sum`: the main job's synthetic sum task (tokenizer, prompts, the 'sum_task' reward, its
  enumerable correct set: the exact target of `disa_jax.eval.exact`).
- `math`, `code`: the math and code tasks over the rewards of `disa_jax.rewards` (no exact target).

Importing this package registers the built-in tasks, and with them the 'sum_task' reward in
`disa_jax.rewards` (which does not import tasks): every entry point that resolves
``reward = "sum_task"`` imports it (the Stage 1 / Stage 3 / evaluation workflows do).
"""
from disa_jax.tasks import code
from disa_jax.tasks import math
from disa_jax.tasks import sum
from disa_jax.tasks.base import Task, get_task, register_task, task_names

__all__ = ["Task", "get_task", "register_task", "task_names", "code", "math", "sum"]
