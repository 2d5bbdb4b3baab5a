"""Cluster rehearsal: the paper's Stage 1 -> 2 -> 3 -> evaluation configs on a 6-device mesh.

`configs/stage1_paper.py`, `stage2_paper.py`, `stage3_paper.py` (DISA) and `eval_paper.py` with
only model paths, sizes, step counts and the engine (the JAX sampler; no GPU here) overridden to the
tiny checkpoints, on 6 fake CPU devices with ``mesh.fsdp=6`` (the single-node layout of
`docs/cluster.md`): 8 rows per micro-batch become 12, and the tiny model's dimensions (64, 128, 4
heads), which 6 divides nowhere, fall back to replication. Stage 3 runs once in this process and
once as 3 processes x 2 devices (`launch/train.py` under `DISA_COORDINATOR`). Every command passes
`disa_jax.workflows.preflight` first, as the launchers do.
"""
import json
import os
import sys
import time

import pytest

from configs import stage3_paper
from disa_jax import testing
from disa_jax.workflows.evaluation import EvalConfig, run_evaluation
from disa_jax.workflows.preflight import preflight
from disa_jax.workflows.stage1 import Stage1Config, run_stage1
from disa_jax.workflows.stage2 import Stage2Config, run_stage2
from disa_jax.workflows.stage3 import Stage3Config, run_stage3
from tests.workflows.test_end_to_end import eval_config, stage1_config, stage2_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FSDP = 6
STAGE3 = "disa,qwen3-4b-base,math"


def _stage3_overrides(policy, train_path, anchor_path):
  """The tiny sizes and step counts of a 1-step Stage 3 run on the fsdp=6 mesh."""
  return {"model.policy_path": policy, "model.dtype": "float32", "model.remat": False,
          "data.train_path": train_path, "data.anchor_path": anchor_path,
          "train.rollout.prompts_per_batch": 3, "train.rollout.group_size": 2,
          "train.rollout.max_response_len": 4, "train.rollout.max_prompt_len": 128,
          "train.rollout.num_minibatches": 1, "engine.kind": "jax", "engine.separate_process": False,
          "engine.dtype": "float32",
          "train.validation.every": 0, "train.checkpoint.every": 1, "train.total_steps": 1,
          "train.progress_bar": False, "mesh.fsdp": FSDP, "mesh.num_devices": FSDP,
          "data.validation_paths": ()}  # the paper's held-out split is not made here


def _stage3_config(overrides, workdir):
  c = stage3_paper.get_config(STAGE3)
  for key, value in overrides.items():
    *path, leaf = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[leaf] = value
  c.workdir = str(workdir)
  return Stage3Config.from_config(c)


@pytest.fixture(scope="module")
def stages_1_2(checkpoints, tmp_path_factory):
  from tests.workflows.conftest import write_dapo_parquet  # pylint: disable=g-import-not-at-top
  tmp = tmp_path_factory.mktemp("rehearsal")
  files = {"train": write_dapo_parquet(str(tmp / "dapo_tiny.parquet"))}
  c1 = stage1_config(checkpoints, files, tmp / "s1", "jax", limit=6)
  c1.scorer.mesh.fsdp, c1.scorer.mesh.num_devices = FSDP, FSDP
  s1 = Stage1Config.from_config(c1)
  preflight(s1)
  start = time.monotonic()
  run_stage1(s1)
  c2 = stage2_config(checkpoints, s1.dataset_path(), tmp / "s2", tmp / "anchor")
  c2.embedding.mesh.fsdp, c2.embedding.mesh.num_devices = FSDP, FSDP
  s2 = Stage2Config.from_config(c2)
  preflight(s2)
  run_stage2(s2)
  return tmp, files, s2, time.monotonic() - start


def _evaluate(export, prompt_files, out_dir):
  cfg = EvalConfig.from_config(eval_config(str(export), prompt_files, out_dir, "jax"))
  preflight(cfg)
  summary = run_evaluation(cfg)
  assert summary.evaluated_now == ("humanevalplus", "math500")
  assert set(summary.tables) == {"mean@2", "pass@1", "pass@3"}


@pytest.mark.slow
def test_paper_configs_stage1_to_evaluation_on_fsdp6(stages_1_2, checkpoints, prompt_files,
                                                     tmp_path):
  tmp, files, s2, seconds_1_2 = stages_1_2
  start = time.monotonic()
  cfg = _stage3_config(_stage3_overrides(checkpoints["reference"], files["train"], s2.anchor_path),
                       tmp_path / "run")
  notes = preflight(cfg)
  assert notes == ["train.rollout.micro_batch_rows=8 -> 12 rows per micro-batch on mesh "
                   "{'data': 1, 'fsdp': 6, 'tensor': 1} (data x fsdp = 6)"]
  summary = run_stage3(cfg)
  assert summary.export == tmp_path / "run" / "final"
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1]
  _evaluate(summary.export, prompt_files, tmp_path / "ev")
  print(f"rehearsal on fsdp=6: Stage 1 + 2 {seconds_1_2:.0f} s, Stage 3 + evaluation "
        f"{time.monotonic() - start:.0f} s")


@pytest.mark.slow
def test_stage3_as_three_processes_on_fsdp6(stages_1_2, checkpoints, prompt_files, tmp_path):
  """The same Stage 3 as 3 JAX processes x 2 CPU devices (one 6-device fsdp mesh)."""
  _, files, s2, _ = stages_1_2
  overrides = _stage3_overrides(checkpoints["reference"], files["train"], s2.anchor_path)
  overrides["mesh.num_devices"] = 0  # all 6 devices of the 3 processes
  workdir = tmp_path / "run"
  port = testing.free_port()
  cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'stage3_paper.py')}:{STAGE3}",
         *[f"--config.{k}={v}" for k, v in overrides.items()], f"--workdir={workdir}"]
  start = time.monotonic()
  results = testing.run_processes(
      [(cmd, dict(os.environ, DISA_COORDINATOR=f"localhost:{port}", DISA_NUM_PROCESSES="3",
                  DISA_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
                  XLA_FLAGS="--xla_force_host_platform_device_count=2")) for pid in range(3)],
      cwd=ROOT, timeout=900)
  outs = [out for _, out in results]
  for pid, out in enumerate(outs):  # kept for a failure's first error (before any abort's dump)
    (tmp_path / f"process{pid}.log").write_text(out)
  assert [rc for rc, _ in results] == [0, 0, 0], f"logs in {tmp_path}/process*.log"
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1]
  assert "8 -> 12 rows per micro-batch on mesh {'data': 1, 'fsdp': 6" in outs[0]
  _evaluate(workdir / "final", prompt_files, tmp_path / "ev")
  print(f"Stage 3 as 3 processes + evaluation: {time.monotonic() - start:.0f} s")
