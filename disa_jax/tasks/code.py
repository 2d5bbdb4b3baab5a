"""The code task: programs run against tests in the sandbox, graded by the registered 'code' reward
(`disa_jax.rewards.registry.code_reward_fn`: stdin/stdout, LiveCodeBench functional or HumanEval+
tests).

Its correct set (every program passing the tests) cannot be enumerated, so it has no exact target:
`TASK.measures` returns None.
"""
from __future__ import annotations

from disa_jax.tasks.base import Task, register_task

TASK = register_task(Task("code"))
