"""The math task: problems with a ground-truth answer, graded by the registered 'math' reward
(`disa_jax.rewards.registry.math_reward_fn`: math-verify in a time-bounded worker pool).

Its correct set cannot be enumerated (any equivalent final answer in any wording is correct), so it
has no exact target: `TASK.measures` returns None.
"""
from __future__ import annotations

from disa_jax.tasks.base import Task, register_task

TASK = register_task(Task("math"))
