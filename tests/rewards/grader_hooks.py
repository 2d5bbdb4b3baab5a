"""Graders for fault injection into `MathGraderPool` (its `grader='module:function'` hook).

They run inside the pool's worker processes, so they live in an importable module, not in a test.
Each behaves like the real grader except on a marker in the response.
"""
import os

from disa_jax.rewards import math_verify_grader


def grade_or_raise(response, ground_truth):
  """Raises ValueError on responses containing 'RAISE'."""
  if "RAISE" in response:
    raise ValueError("injected grader failure")
  return math_verify_grader.grade(response, ground_truth)


def grade_or_die(response, ground_truth):
  """Kills its own worker process on responses containing 'DIE'."""
  if "DIE" in response:
    os._exit(7)
  return math_verify_grader.grade(response, ground_truth)


def die_at_start(response, ground_truth):
  """Kills its worker at the warm-up item: the worker never becomes ready."""
  del response, ground_truth
  os._exit(3)
