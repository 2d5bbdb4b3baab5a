"""Every value of every typed config is checked (`disa_jax.config.from_mapping`).

- NaN and +-inf are refused in every float field of every command's config (the paper configs of
  each launcher, every Stage 3 objective), naming the dotted field and the value: no field gives
  infinity a meaning, and a range check written as a comparison lets NaN through (``lr=inf`` or
  ``weight_decay=nan`` were accepted).
- An objective whose signal is relative to its group (`Objective.group_relative`) refuses
  ``rollout.group_size < 2``, naming the field and the objective; a group of one row gives every
  row the signal 0.
"""
import dataclasses
import math
import typing

import pytest

from configs import (eval_paper, main, nstudy_paper, offline_synthetic, sft_paper, stage1_paper,
                     stage2_paper, stage3_base, stage3_paper)
from disa_jax import config as config_lib
from disa_jax.pipeline.offline_job import OfflineConfig
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.rl import objectives
from disa_jax.rl.config import TrainConfig
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.nstudy import NStudyConfig
from disa_jax.workflows.sft import SftConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config
from disa_jax.workflows.stage3 import Stage3Config



def _stage3(method):
  """The Stage 3 paper config of ``method`` (VarGrad, outside the paper: GRPO's, its objective
  replaced)."""
  c = stage3_paper.get_config(f"{'grpo' if method == 'vargrad' else method},qwen3-4b-base,math")
  if method == "vargrad":
    c.train.objective = stage3_base.objective("vargrad")
  return c


def _evaluate():
  c = eval_paper.get_config()
  c.model_path, c.output_dir = "/models/x", "/eval/x"  # (the command line's paths)
  return c


# (name, ConfigDict, the launcher's conversion).
COMMANDS = [
    ("stage1", stage1_paper.get_config(), Stage1Config.from_config),
    ("stage2", stage2_paper.get_config(), Stage2Config.from_config),
    *[(f"stage3:{m}", _stage3(m), Stage3Config.from_config)
      for m in ("disa", "flowrl", "grpo", "gspo", "vargrad")],
    ("evaluate", _evaluate(), EvalConfig.from_config),
    ("sft", sft_paper.get_config(), SftConfig.from_config),
    ("nstudy", nstudy_paper.get_config(), NStudyConfig.from_config),
    ("offline", offline_synthetic.get_config(), OfflineConfig.from_config),
    ("main", main.get_config(), MainConfig.from_config),
]


def _float_fields(obj, prefix=""):
  """The dotted names of the float fields of a typed config (recursing into its sections, each by
  its own class: an objective's fields are its class's)."""
  hints = typing.get_type_hints(type(obj))
  for f in dataclasses.fields(obj):
    if not f.init:
      continue
    value, hint = getattr(obj, f.name), hints[f.name]
    if hint is float or hint == (float | None):
      yield prefix + f.name
    elif dataclasses.is_dataclass(value):
      yield from _float_fields(value, f"{prefix}{f.name}.")
    elif isinstance(value, dict):  # a section of named sections (the main job's runs)
      for key, item in value.items():
        if dataclasses.is_dataclass(item):
          yield from _float_fields(item, f"{prefix}{f.name}.{key}.")


def _set(raw, path, value):
  *sections, last = path.split(".")
  for s in sections:
    raw = raw.setdefault(s, {})
  raw[last] = value


@pytest.mark.parametrize("name,config,convert", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_float_field_refuses_nan_and_inf(name, config, convert):
  fields = sorted(set(_float_fields(convert(config))))
  assert len(fields) >= 3, (name, fields)
  for k, path in enumerate(fields):
    bad = (math.nan, math.inf, -math.inf)[k % 3]
    raw = config.to_dict()
    _set(raw, path, bad)
    with pytest.raises(ValueError, match=f"{path} must be a finite number, got {bad!r}"):
      convert(raw)


@pytest.mark.parametrize("path,bad", [
    ("train.optim.lr", math.inf), ("train.optim.weight_decay", math.nan),
    ("train.optim.eps", math.nan), ("train.optim.grad_clip", math.nan),
    ("train.rollout.temperature", math.inf), ("train.objective.beta", math.inf),
    ("train.objective.reward_transform.shift", math.nan)])
def test_the_reported_stage3_values_are_refused(path, bad):
  c = stage3_paper.get_config("disa,qwen3-4b-base,math")
  raw = c.to_dict()
  _set(raw, path, bad)
  with pytest.raises(ValueError, match=rf"^config\.{path} must be a finite number, got {bad!r}$"):
    Stage3Config.from_config(raw)
  s1 = stage1_paper.get_config()
  s1.beta = math.inf
  with pytest.raises(ValueError, match=r"^config\.beta must be a finite number, got inf$"):
    Stage1Config.from_config(s1)


def _train(objective, group_size, **rollout):
  return config_lib.from_mapping(TrainConfig, dict(
      objective=objective, rollout=dict(prompts_per_batch=4, group_size=group_size,
                                        num_minibatches=1, **rollout)), "train")


@pytest.mark.parametrize("objective", [
    dict(name="grpo"), dict(name="gspo"), dict(name="vargrad"),
    dict(name="vargrad", leave_one_out=True), dict(name="disa"), dict(name="flowrl"),
    dict(name="disa", reward_transform=dict(kind="group_zscore", ddof=1))],
    ids=lambda o: "-".join(str(v) for v in o.values()))
def test_group_relative_objectives_refuse_groups_of_one(objective):
  name = objective["name"]
  with pytest.raises(ValueError, match=rf"rollout\.group_size must be >= 2 for objective "
                                       rf"'{name}': .*group.*, got 1$"):
    _train(objective, 1)
  assert _train(objective, 2).rollout.group_size == 2


def test_objectives_whose_rows_stand_alone_accept_groups_of_one():
  raw = dict(name="disa", reward_transform=dict(kind="raw"))  # r~ = r: no group statistic
  assert not config_lib.from_mapping(objectives.Objective, raw).group_relative
  assert _train(raw, 1).rollout.group_size == 1
  assert not objectives.ReplaySft().group_relative
