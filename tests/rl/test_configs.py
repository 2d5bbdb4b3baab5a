"""Stage 3 configs: every paper experiment builds a valid TrainConfig; errors name the field."""
import importlib.util
import os
import re

import pytest

from disa_jax.rl.config import RolloutCfg, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


EXPERIMENTS = (
    # Tables 1-2: 4 methods x 2 backbones x 2 tasks.
    [f"{m},{b},{t}" for m in ("disa", "flowrl", "grpo", "gspo")
     for b in ("qwen2.5-7b", "qwen3-4b-base") for t in ("math", "code")]
    # Fig. 4: weaker proposal; Fig. 5: beta sweep.
    + ["disa,qwen3-4b-base,math,proposal=qwen3-4b-instruct-2507"]
    + [f"disa,qwen2.5-7b,code,beta={b}" for b in (10, 15, 20)])


@pytest.mark.parametrize("arg", EXPERIMENTS)
def test_every_experiment_validates(arg):
  cd = _load("stage3_paper").get_config(arg)
  cfg = TrainConfig.from_dict(cd.to_dict())
  method = arg.split(",")[0]
  assert cfg.loss.method == method
  assert cfg.optim.lr == 1e-6 and cfg.rollout.prompts_per_batch == 128
  assert cfg.rollout.group_size == 8
  assert (cfg.rollout.max_prompt_len, cfg.rollout.max_response_len) == (2048, 16384)
  assert (cfg.eval.temperature, cfg.eval.top_p) == (0.6, 0.95)
  if method == "gspo":
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
  if method == "disa":
    assert cfg.data.anchor_path
  if "beta=" in arg:
    assert cfg.loss.beta == float(arg.split("beta=")[1])
  elif method in ("disa", "flowrl"):
    assert cfg.loss.beta == 15.0


def test_distinct_anchor_per_ablation():
  mod = _load("stage3_paper")
  paths = {mod.get_config(a).data.anchor_path for a in EXPERIMENTS if a.startswith("disa")}
  assert len(paths) == len([a for a in EXPERIMENTS if a.startswith("disa")]) - 1  # beta=15 twice


def test_bad_values_name_field_and_value():
  cd = _load("stage3_paper").get_config("disa,qwen2.5-7b,math")
  cd.optim.lr = 0.0
  with pytest.raises(ValueError, match=r"optim.lr must be > 0, got 0.0"):
    TrainConfig.from_dict(cd.to_dict())
  d = _load("stage3_paper").get_config("disa,qwen2.5-7b,math").to_dict()
  d["loss"]["bogus"] = 1
  with pytest.raises(ValueError, match=r"config.loss: unknown field\(s\) \['bogus'\]"):
    TrainConfig.from_dict(d)
  d = _load("stage3_paper").get_config("grpo,qwen2.5-7b,math").to_dict()
  d["rollout"]["group_size"] = "8"
  with pytest.raises(ValueError, match=r"config.rollout.group_size must be an int, got '8'"):
    TrainConfig.from_dict(d)
  with pytest.raises(ValueError, match=r"rollout.num_minibatches must divide"):
    RolloutCfg(prompts_per_batch=3, group_size=1, num_minibatches=2)
  d = _load("stage3_paper").get_config("disa,qwen2.5-7b,math").to_dict()
  d["data"]["anchor_path"] = ""
  with pytest.raises(ValueError, match=r"data.anchor_path .*required for method='disa'"):
    TrainConfig.from_dict(d)
  with pytest.raises(ValueError, match=r"METHOD must be one of .* got 'ppo'"):
    _load("stage3_paper").get_config("ppo,qwen2.5-7b,math")
  with pytest.raises(ValueError, match=r"proposal=.*only applies to 'disa' and 'flowrl'"):
    _load("stage3_paper").get_config("grpo,qwen2.5-7b,math,proposal=qwen3-4b-instruct-2507")
  with pytest.raises(ValueError, match=r"replay only applies to 'disa' and 'flowrl', got method 'gspo'"):
    _load("stage3_paper").get_config("gspo,qwen2.5-7b,math,replay=0.25")


@pytest.mark.parametrize("method", ["disa", "flowrl"])
def test_replay_variant_reads_the_stage1_samples_of_the_proposal(method):
  cd = _load("stage3_paper").get_config(f"{method},qwen3-4b-base,math,replay=0.25")
  cfg = TrainConfig.from_dict(cd.to_dict())
  assert cfg.replay.fraction == 0.25
  assert cfg.replay.path == "stage1/qwen3-4b-base_math_qwen3-235b-a22b-instruct-2507_beta15"
  plain = TrainConfig.from_dict(_load("stage3_paper").get_config(f"{method},qwen3-4b-base,math").to_dict())
  assert not plain.replay.enabled


def test_every_base_field_is_commented():
  lines = open(os.path.join(ROOT, "configs", "stage3_base.py")).read().splitlines()
  fields = 0
  for i, line in enumerate(lines):
    m = re.match(r"\s*c\.([\w.]+) = (?!ml_collections\.ConfigDict)", line)
    if m:
      fields += 1
      commented = "#" in line or lines[i - 1].strip().startswith("#")
      assert commented, f"configs/stage3_base.py:{i + 1} field {m.group(1)} has no comment"
  assert fields >= 50
  # ... and the ConfigDict covers exactly the TrainConfig fields.
  TrainConfig.from_dict(_load("stage3_base").get_config().to_dict() | {
      "data": {**_load("stage3_base").get_config().data.to_dict(), "anchor_path": "x"}})
