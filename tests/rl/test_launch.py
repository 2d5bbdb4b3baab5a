"""launch/train.py end to end: tiny HF checkpoint, veRL jsonl prompts, math reward, GRPO steps; a
rerun with another total_steps is refused (``overwrite`` starts afresh)."""
import json
import os
import subprocess
import sys

import pytest

from disa_jax import testing
from disa_jax.rl.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_launch_runs_one_step_and_refuses_other_steps(tmp_path):
  ckpt = testing.save_tiny_checkpoint(str(tmp_path / "model"), family="qwen3")
  rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "data_source": "toy",
           "ability": "math", "reward_model": {"ground_truth": str(2 * i)},
           "extra_info": {"index": i}} for i in range(4)]
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)

  def launch(steps, *extra, ok=True):
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"),
           "--config=" + os.path.join(ROOT, "configs", "stage3_paper.py") + ":grpo,qwen3-4b-base,math",
           f"--config.model.policy_path={ckpt}", "--config.model.dtype=float32",
           "--config.model.remat=False", f"--config.data.train_path={data}",
           "--config.data.rendering=plain",
           "--config.train.rollout.prompts_per_batch=2", "--config.train.rollout.group_size=2",
           "--config.train.rollout.max_response_len=4", "--config.train.rollout.max_prompt_len=128", "--config.train.rollout.num_minibatches=1",
           "--config.train.rollout.micro_batch_rows=4", "--config.engine.kind=jax",
           "--config.engine.separate_process=False", "--config.engine.dtype=float32",
           "--config.train.validation.every=0", "--config.data.validation_paths=()",
           "--config.train.checkpoint.every=1", f"--config.train.total_steps={steps}",
           "--config.train.progress_bar=False", f"--workdir={workdir}", *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert (out.returncode == 0) == ok, out.stderr[-4000:]
    return out

  launch(1)
  # Another total_steps is another learning-rate schedule: refused, naming the field (issue 39).
  refused = launch(2, ok=False)
  assert "train.total_steps: stored 1, this run 2" in refused.stderr, refused.stderr[-4000:]
  launch(2, "--config.overwrite=True")  # discards the 1-step run and trains 2 steps
  rows = read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2]
  assert json.loads((workdir / "config.json").read_text())["train"]["objective"]["name"] == "grpo"
  assert sorted(os.listdir(workdir / "checkpoints")) == ["1", "2"]
  assert (workdir / "final" / "export_info.json").exists()  # the exported policy
