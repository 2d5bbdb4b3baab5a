"""Config dataclasses are frozen and keyword-only (issue 64, item 5): every dataclass that a command's
config is converted into (`disa_jax.config.from_mapping` / `codec.read_config`, walked from the
commands' config types through their fields' types and a tagged union's variants) is built with
keywords only, so a field added or reordered cannot shift a positional construction silently."""
import dataclasses
import typing

import pytest

from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.pipeline.job_config import MainConfig, RunSpec
from disa_jax.pipeline.offline_job import OfflineConfig
from disa_jax.rl.config import TrainConfig
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.nstudy import NStudyConfig
from disa_jax.workflows.sft import SftConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config
from disa_jax.workflows.stage3 import Stage3Config

ROOTS = (Stage1Config, Stage2Config, Stage3Config, EvalConfig, SftConfig, NStudyConfig, MainConfig,
         OfflineConfig, TrainConfig, RunSpec)


def _subclasses(cls):
  for sub in cls.__subclasses__():
    yield sub
    yield from _subclasses(sub)


def _config_classes():
  """Every dataclass reachable from `ROOTS` through field types (and the subclasses of each)."""
  seen, todo = {}, list(ROOTS)
  while todo:
    cls = todo.pop()
    if cls in seen or not dataclasses.is_dataclass(cls):
      continue
    seen[cls] = None
    todo.extend(_subclasses(cls))
    hints = typing.get_type_hints(cls)
    stack = [hints[f.name] for f in dataclasses.fields(cls)]
    while stack:
      hint = stack.pop()
      stack.extend(typing.get_args(hint))
      if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        todo.append(hint)
  return list(seen)


def test_every_config_dataclass_is_frozen_and_keyword_only():
  classes = _config_classes()
  assert len(classes) >= 45, [c.__name__ for c in classes]  # the walk reaches the sections
  loose = [f"{c.__module__}.{c.__qualname__}" for c in classes
           if not c.__dataclass_params__.frozen
           or any(f.init and not f.kw_only for f in dataclasses.fields(c))]
  assert not loose, f"config dataclasses not frozen and keyword-only: {loose}"


def test_a_positional_construction_is_refused():
  with pytest.raises(TypeError, match="positional"):
    RewardTransform("affine", 2.0, 0.5)  # pylint: disable=too-many-function-args
  assert RewardTransform(kind="affine", scale=2.0, shift=0.5).scale == 2.0
