"""Tasks: each ability's reward and optional exact target, read from the one reward registry.

- `base`: `Task` (name = reward name = prompt ability; `reward_fn`, `correct_set`, `measures`).
- `registry`: `get_task(ability)`, `task_names()`: views of `disa_jax.rewards`' registry, where a
  task is registered with its reward (`register_reward(name, fn, correct_set=...)`), and
  `import_reward_plugins(modules)`, the one loader of the plugins that register more, which every
  workflow calls.
- `sum`: the main job's synthetic sum task (tokenizer, prompts, the 'sum_task' reward and its
  enumerable correct set: the exact target of `disa_jax.eval.exact`).
- math and code are the registry's built-in rewards 'math' and 'code' (no exact target).

Importing this package registers the sum task in `disa_jax.rewards` (which does not import
tasks): every entry point that resolves ``reward = "sum_task"`` imports it (the Stage 1 /
Stage 3 / evaluation workflows do).
"""
from disa_jax.tasks import sum
from disa_jax.tasks.base import Task
from disa_jax.tasks.registry import get_task, import_reward_plugins, task_names

__all__ = ["Task", "get_task", "import_reward_plugins", "task_names", "sum"]
