"""Stage 3 configs: every paper experiment builds a valid Stage3Config; errors name the field."""
import os
import re

import pytest

from configs import stage3_base, stage3_paper
from disa_jax.rl import objectives
from disa_jax.rl.config import RolloutConfig, TrainConfig
from disa_jax.workflows.stage3 import Stage3Config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXPERIMENTS = (
    # Tables 1-2: 4 methods x 2 backbones x 2 tasks.
    [f"{m},{b},{t}" for m in ("disa", "flowrl", "grpo", "gspo")
     for b in ("qwen2.5-7b", "qwen3-4b-base") for t in ("math", "code")]
    # Fig. 3: weaker proposal; Fig. 4: beta sweep.
    + ["disa,qwen3-4b-base,math,proposal=qwen3-4b-instruct-2507"]
    + [f"disa,qwen2.5-7b,code,beta={b}" for b in (10, 15, 20)])


@pytest.mark.parametrize("arg", EXPERIMENTS)
def test_every_experiment_validates(arg):
  cfg = Stage3Config.from_config(stage3_paper.get_config(arg))
  method = arg.split(",")[0]
  t = cfg.train
  assert t.objective.name == method and isinstance(t.objective, objectives.REGISTRY[method])
  assert t.optim.lr == 1e-6 and t.rollout.prompts_per_batch == 128
  assert t.rollout.group_size == 8
  assert (t.rollout.max_prompt_len, t.rollout.max_response_len) == (2048, 16384)
  assert (t.validation.temperature, t.validation.top_p) == (0.6, 0.95)
  if method == "gspo":
    assert (t.objective.eps_low, t.objective.eps_high) == (3e-4, 4e-4)  # the class's own defaults
  if method == "grpo":
    assert (t.objective.eps_low, t.objective.eps_high) == (0.2, 0.2)  # paper eq. 2
  assert bool(cfg.data.anchor_path) == (method == "disa")
  if "beta=" in arg:
    assert t.objective.beta == float(arg.split("beta=")[1])
  elif method in ("disa", "flowrl"):
    assert t.objective.beta == 15.0 and t.objective.scale == "mean"


def test_distinct_anchor_per_ablation():
  paths = {stage3_paper.get_config(a).data.anchor_path for a in EXPERIMENTS if a.startswith("disa")}
  assert len(paths) == len([a for a in EXPERIMENTS if a.startswith("disa")]) - 1  # beta=15 twice


def test_bad_values_name_field_and_value():
  cd = stage3_paper.get_config("disa,qwen2.5-7b,math")
  cd.train.optim.lr = 0.0
  with pytest.raises(ValueError, match=r"config.train.optim.lr must be > 0, got 0.0"):
    Stage3Config.from_config(cd)
  cd = stage3_paper.get_config("disa,qwen2.5-7b,math")
  cd.train.objective.bogus = 1
  with pytest.raises(ValueError, match=r"config.train.objective: unknown field\(s\) \['bogus'\]"):
    Stage3Config.from_config(cd)
  d = stage3_paper.get_config("grpo,qwen2.5-7b,math").to_dict()
  d["train"]["rollout"]["group_size"] = "8"
  with pytest.raises(ValueError, match=r"config.train.rollout.group_size must be int, got '8'"):
    Stage3Config.from_config(d)
  with pytest.raises(ValueError, match=r"rollout.num_minibatches must divide the 3 rows of a step"):
    TrainConfig(rollout=RolloutConfig(prompts_per_batch=3, group_size=1, num_minibatches=2))
  with pytest.raises(ValueError, match=r"rollout.row_len must be 0 or >= max_prompt_len \+ "
                     r"max_response_len = 24 .*, got 20"):
    RolloutConfig(max_prompt_len=16, max_response_len=8, row_len=20)
  with pytest.raises(ValueError, match=r"rollout.micro_batch_rows must be >= 1, got 0"):
    RolloutConfig(micro_batch_rows=0)
  layout = RolloutConfig(max_prompt_len=16, max_response_len=8, micro_batch_rows=2).layout([5], 8)
  assert (layout.packing, layout.row_len, layout.rows, layout.slots) == (True, 24, 2, 32)
  padded = RolloutConfig(packing=False, micro_batch_rows=2).layout([5, 17, 9], 8)
  assert (padded.packing, padded.row_len, padded.slots) == (False, 24, 2)  # longest, rounded up
  cd = stage3_paper.get_config("disa,qwen2.5-7b,math")
  cd.data.anchor_path = ""
  with pytest.raises(ValueError, match=r"data.anchor_path is required for objective 'disa'"):
    Stage3Config.from_config(cd)
  cd = stage3_paper.get_config("gspo,qwen2.5-7b,math")
  cd.train.objective.name = "ppo"
  with pytest.raises(ValueError, match=r"config.train.objective.name must be one of .* got 'ppo'"):
    Stage3Config.from_config(cd)
  with pytest.raises(ValueError, match=r"METHOD must be one of .* got 'ppo'"):
    stage3_paper.get_config("ppo,qwen2.5-7b,math")
  with pytest.raises(ValueError, match=r"proposal= only applies to disa and flowrl"):
    stage3_paper.get_config("grpo,qwen2.5-7b,math,proposal=qwen3-4b-instruct-2507")
  with pytest.raises(ValueError, match=r"replay= only applies to disa and flowrl, got method 'gspo'"):
    stage3_paper.get_config("gspo,qwen2.5-7b,math,replay=0.25")


def test_share_prompts_needs_packing_and_reaches_the_layout():
  with pytest.raises(ValueError, match=r"rollout.share_prompts needs rollout.packing=True .*, "
                                       r"got True"):
    RolloutConfig(packing=False, share_prompts=True)
  d = stage3_paper.get_config("grpo,qwen2.5-7b,math").to_dict()
  d["train"]["rollout"]["share_prompts"] = "yes"
  with pytest.raises(ValueError,
                     match=r"config.train.rollout.share_prompts must be bool, got 'yes'"):
    Stage3Config.from_config(d)
  rc = RolloutConfig(max_prompt_len=16, max_response_len=8, share_prompts=True)
  assert rc.layout([5], 8).share_prompts and not RolloutConfig().layout([5], 8).share_prompts


def test_replay_is_refused_for_on_policy_objectives_by_the_objective():
  cd = stage3_paper.get_config("gspo,qwen2.5-7b,math")
  cd.train.replay.fraction = 0.25
  cd.data.replay_path = "x"
  with pytest.raises(ValueError, match=r"replay.fraction=0.25 is not allowed for objective 'gspo'"):
    Stage3Config.from_config(cd)


@pytest.mark.parametrize("method", ["disa", "flowrl"])
def test_replay_variant_reads_the_stage1_samples_of_the_proposal(method):
  cfg = Stage3Config.from_config(stage3_paper.get_config(f"{method},qwen3-4b-base,math,replay=0.25"))
  assert cfg.train.replay.fraction == 0.25
  assert cfg.data.replay_path == "stage1/qwen3-4b-base_math_qwen3-235b-a22b-instruct-2507_beta15/stage1"
  plain = Stage3Config.from_config(stage3_paper.get_config(f"{method},qwen3-4b-base,math"))
  assert not plain.train.replay.enabled and not plain.data.replay_path


def test_every_base_field_is_commented():
  lines = open(os.path.join(ROOT, "configs", "stage3_base.py")).read().splitlines()
  fields = 0
  for i, line in enumerate(lines):
    m = re.match(r"\s*[ct]\.([\w.]+) = (?!ml_collections\.ConfigDict\(\)$)", line)
    if m:
      fields += 1
      commented = "#" in line or lines[i - 1].strip().startswith("#")
      assert commented, f"configs/stage3_base.py:{i + 1} field {m.group(1)} has no comment"
  assert fields >= 45
  # ... and the ConfigDict covers exactly the Stage3Config fields (no unknown, none missing).
  c = stage3_base.get_config()
  c.model.policy_path, c.data.train_path, c.data.anchor_path = "m", "d", "a"
  Stage3Config.from_config(c)
