"""Tasks: each in one module, with its prompt formats and template, its reward and optional exact
target, registered once in `registry`.

- `base`: `Task` (name = reward name = prompt ability; `reward_fn`, `correct_set`, `measures`,
  `formats`, `ground_truth`) and `PromptFormat` (a published prompt-file format: rows -> records).
- `registry`: `register_task(task, reward=fn)`, `get_task(ability)`, `task_names()`, the prompt
  formats by name, and `import_reward_plugins(modules)`, the one loader of the plugins that register
  more, which every workflow calls.
- `math`: the 'math' task (the math template; formats 'math', 'minerva', 'olympiadbench').
- `code`: the 'code' task (the code templates; formats 'humanevalplus', 'rllm_code').
- `sum`: the main job's synthetic sum task (tokenizer, prompts, the 'sum_task' reward and its
  enumerable correct set: the exact target of `disa_jax.eval.exact`).
- `verl`: the veRL format, the one every task's prompt sets are stored in.
- `prompts`: `load_prompts(path, fmt)`, `records_from_rows`: any registered format -> records.

Importing this package registers the built-in tasks (their rewards in `disa_jax.rewards`, which does
not import tasks): every entry point that grades or loads prompts imports it (the Stage 1 / Stage 3
/ evaluation workflows do).
"""
from disa_jax.tasks import verl
from disa_jax.tasks import math
from disa_jax.tasks import code
from disa_jax.tasks import sum
from disa_jax.tasks import prompts
from disa_jax.tasks.base import PromptFormat, Task
from disa_jax.tasks.prompts import load_prompts, records_from_rows
from disa_jax.tasks.registry import get_task, import_reward_plugins, register_task, task_names

__all__ = ["PromptFormat", "Task", "get_task", "import_reward_plugins", "register_task",
           "task_names", "load_prompts", "records_from_rows", "code", "math", "prompts", "sum",
           "verl"]
