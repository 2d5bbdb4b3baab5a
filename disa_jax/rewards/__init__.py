"""Verifiable rewards: math (math-verify, time-bounded) and code (sandboxed execution).

- `math_reward(response, ground_truth) -> float`, `math_rewards(responses, ground_truths, *,
  timeout_s, workers, return_errors=False) -> [n] float32 | Graded` (`disa_jax.rewards.math_pool`;
  answer extraction and normalisation in `math_answer`, math-verify calls in `math_verify_grader`).
  `Graded(reward, error)` (`graded`) marks the items whose grader raised or timed out.
- `disa_jax.rewards.code`: `run_stdio(program, cases, timeout_s) -> list[bool]`,
  `run_humaneval(problem, completion, timeout_s) -> bool`, `extract_code(response)`; the sandbox
  itself is `disa_jax.rewards.sandbox`.
- Registry: `get_reward_fn(name)` is the one `RewardFn` type, ``(responses, metas) -> Graded``
  (rewards plus grading errors; `disa_jax.rewards.graded`), for every reward added with
  `register_reward(name, fn, correct_set=...)`: 'math', 'code' and 'sum_task' are registered by
  their task modules when `disa_jax.tasks` is imported. It is the one registry of tasks: `correct_set_of(name)` is a task's
  enumerable correct set (None for math and code), which `disa_jax.tasks.get_task` reads.
"""

from disa_jax.rewards import code
from disa_jax.rewards import sandbox
from disa_jax.rewards.graded import ERROR_SHARE_WARN, Graded, GraderErrorWarning, Response, RewardFn
from disa_jax.rewards.math_pool import MathGraderPool
from disa_jax.rewards.math_pool import math_reward
from disa_jax.rewards.math_pool import math_rewards
from disa_jax.rewards.registry import correct_set_of
from disa_jax.rewards.registry import get_reward_fn
from disa_jax.rewards.registry import register_reward
from disa_jax.rewards.registry import reward_names

__all__ = ["code", "sandbox", "ERROR_SHARE_WARN", "Graded", "GraderErrorWarning", "Response",
           "RewardFn", "MathGraderPool", "math_reward", "math_rewards", "correct_set_of", "get_reward_fn",
           "register_reward", "reward_names"]
