"""The fault matrix: kill -9 from outside at seeded random moments in Stage 1, Stage 2, Stage 3 and
evaluation, rerun to completion, and compare with an uninterrupted run bit for bit; no
``/dev/shm/disa_ro_*`` segment of a killed run may stay behind.

Each trial is a fresh output directory: the stage's worker (`kill_worker.py` on one CPU device, a
process forked by the module's fork server, `fork_server`, where a fresh worker would have
finished its imports) is SIGKILLed a delay after it started, drawn uniformly
from [0, 1] x the time after its start of an uninterrupted run with a warm compilation cache (seeded per
stage; a run that ends before its delay is a kill that did not land), then rerun to completion.
In Stage 3 every other trial waits for the first checkpoint and draws the delay over the time left,
so that reruns resume from mid-run checkpoints (at least one must). Stage 1 samples in a separate
generation process (shared-memory exchange), parquet parts, so kills land in part writes and engine
traffic. The trial count is ``DISA_FAULT_TRIALS`` (default 10 per stage); the figures of a run print at the end.
"""
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from configs import eval_paper, stage3_paper
from disa_jax import config as config_lib
from disa_jax import models
from disa_jax.anchor import Anchor
from disa_jax.estimators import load_stage1
from disa_jax.rollout import shm
from tests.workflows.conftest import write_dapo_parquet
from tests.workflows.test_kill_resume import _stage1_config_dict, _stage2_config

ROOT = Path(__file__).resolve().parents[2]
TRIALS = int(os.environ.get("DISA_FAULT_TRIALS", "10"))
N_PROMPTS = 6

pytestmark = pytest.mark.slow


def _stage3_config(ckpts, train_path, workdir) -> dict:
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.workdir, c.model.policy_path, c.data.train_path = str(workdir), ckpts["reference"], train_path
  c.data.validation_paths = ()  # the paper's held-out split is not made here
  c.model.dtype, c.model.remat = "float32", False
  c.data.reward, c.data.reward_plugins = "toy_contains", ("tests.workflows.toy_reward",)
  r = c.train.rollout
  r.prompts_per_batch, r.group_size, r.max_response_len = 2, 2, 4
  r.max_prompt_len = 128  # packed rows of 132 tokens, not the paper's 2,052 (~1 s a step here)
  r.num_minibatches, r.micro_batch_rows = 1, 4
  c.engine.kind, c.engine.separate_process, c.engine.dtype = "jax", False, "float32"
  c.train.validation.every, c.train.checkpoint.every, c.train.total_steps = 0, 1, 6
  c.train.checkpoint.async_save, c.train.progress_bar, c.train.tensorboard = True, False, False
  return c.to_dict()


def _eval_config(ckpt, bench, out_dir) -> dict:
  c = eval_paper.get_config("math")
  c.model_path, c.output_dir, c.label = ckpt, str(out_dir), "tiny"
  for name in c.benchmarks:
    c.benchmarks[name] = bench if name == "math500" else ""
  c.math_k, c.max_tokens = 2, 6
  c.engine.kind, c.engine.dtype, c.engine.separate_process = "jax", "float32", False
  return c.to_dict()


# What must be equal, bit for bit, between a resumed run and the uninterrupted one.


def _stage1_outputs(out_dir: Path):
  data = load_stage1(out_dir / "stage1", "parquet")
  summary = json.loads((out_dir / "stage1_summary.json").read_text())
  return ({r["prompt_id"]: json.dumps(r, sort_keys=True) for r in data.records},
          {k: v for k, v in summary.items() if k not in ("run", "dataset")})  # figures, its path


def _stage2_outputs(out_dir: Path):
  anchor = Anchor.load(out_dir / "anchor")
  emb = np.load(out_dir / "s2" / "embeddings.npy")
  summary = json.loads((out_dir / "s2" / "stage2_summary.json").read_text())
  summary = {k: v for k, v in summary.items() if k not in ("resumed", "anchor_path",
                                                           "validation_curve")}
  return emb.tobytes(), np.asarray(anchor(emb)).tobytes(), json.dumps(anchor.meta, sort_keys=True,
                                                                      default=str), summary


def _stage3_outputs(workdir: Path):
  final = models.read_checkpoint_tensors(str(workdir / "final"))
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  learned = [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
             for r in rows]
  return {k: v.tobytes() for k, v in final.items()}, learned


def _eval_outputs(out_dir: Path):
  return ((out_dir / "math500.json").read_text(), (out_dir / "math500_responses.jsonl").read_text())


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory, fork_server):
  root = tmp_path_factory.mktemp("fault_matrix")
  bench = root / "math500.jsonl"
  fixtures = ROOT / "tests" / "fixtures" / "benchmarks" / "math500_simplerl_sample.jsonl"
  rows = sorted((json.loads(l) for l in fixtures.read_text().splitlines()),
                key=lambda r: len(r["problem"]))[:2]
  bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return {"root": root, "server": fork_server, "ckpts": checkpoints, "bench": str(bench),
          "prompts": write_dapo_parquet(str(root / "dapo.parquet"), N_PROMPTS)}


def _configs(setup, stage: str, out: Path) -> dict:
  ck = setup["ckpts"]
  if stage == "stage1":
    c = _stage1_config_dict(ck, setup["prompts"], out, "parquet")
    c.engine.separate_process = True  # the generation process and its shared-memory segments
    return c.to_dict()
  if stage == "stage2":
    if "stage1_dir" not in setup:  # Stage 2 run alone (-k stage2): a Stage 1 dataset to fit on
      setup["stage1_dir"] = setup["root"] / "stage2_input"
      setup["stage1_dir"].mkdir()
      log = setup["stage1_dir"] / "stderr.log"
      proc, _ = _start("stage1", _configs(setup, "stage1", setup["stage1_dir"]), setup["server"], log)
      _finish(proc, "Stage 1 for Stage 2", log)
    return config_lib.to_dict(_stage2_config(ck, setup["stage1_dir"] / "stage1", out))
  if stage == "stage3":
    return _stage3_config(ck, setup["prompts"], out)
  return _eval_config(ck["proposal"], setup["bench"], out)


OUTPUTS = {"stage1": _stage1_outputs, "stage2": _stage2_outputs, "stage3": _stage3_outputs,
           "eval": _eval_outputs}


def _start(stage, config, server, log: Path):
  """The worker, forked by the module's fork server once everything is imported (where a fresh
  worker prints START): (process, start time). Its stdout and stderr go to ``log``."""
  proc = server.start(stage, config, "none", log)
  return proc, time.time()


def _finish(proc, what, log: Path):
  proc.communicate(timeout=900)
  assert proc.returncode == 0, (what, log.read_text()[-4000:])


def _wait_for(path: Path, proc) -> None:
  """Until ``path`` exists (or the worker ended)."""
  while not path.exists() and proc.poll() is None:
    time.sleep(0.02)


def _leftover_segments(pids):
  """/dev/shm segments named after a worker (creator pid in the name), after a grace period for
  the generation process's watchdog to remove them."""
  deadline = time.time() + 20
  while True:
    left = [n for n in os.listdir("/dev/shm") if n.startswith(shm.PREFIX)
            and any(n.startswith(f"{shm.PREFIX}{p}_") for p in pids)]
    if not left or time.time() > deadline:
      return left
    time.sleep(0.5)


@pytest.mark.parametrize("stage", ["stage1", "stage2", "stage3", "eval"])  # a group each
# (tests/conftest.py PER_PARAMETER): the stages run on both workers
def test_kill9_at_random_moments_then_rerun_is_bit_identical(setup, stage):
  root = setup["root"] / stage
  t0 = time.time()
  root.mkdir(parents=True)
  log = root / "stderr.log"
  pids = []
  for name in ("ref", "warm"):  # the second run finds the compilation cache warm, as the trials do
    ref, started = _start(stage, _configs(setup, stage, root / name), setup["server"], log)
    pids.append(ref.pid)
    _finish(ref, f"uninterrupted run ({name})", log)
    wall = time.time() - started  # the stage's work, after the imports
  if stage == "stage1":
    setup["stage1_dir"] = root / "ref"  # Stage 2 fits on it
  want = OUTPUTS[stage](root / "ref")
  assert OUTPUTS[stage](root / "warm") == want, f"{stage}: two uninterrupted runs differ"
  rng = random.Random(f"fault-matrix-{stage}")
  landed, identical, resumed = 0, 0, 0
  for trial in range(TRIALS):
    out = root / f"trial{trial}"
    config = _configs(setup, stage, out)
    proc, started = _start(stage, config, setup["server"], log)
    pids.append(proc.pid)
    delay = rng.uniform(0.0, 1.0)
    if stage == "stage3" and trial % 2:  # after the first checkpoint: the rerun resumes mid-run
      _wait_for(out / "checkpoints" / "1", proc)
      delay *= max(wall - (time.time() - started), 0.0)
    else:
      delay *= wall
    try:
      proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
      os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=120)
    landed += proc.returncode == -signal.SIGKILL
    rerun, _ = _start(stage, config, setup["server"], log)
    pids.append(rerun.pid)
    _finish(rerun, f"rerun of trial {trial}", log)
    if stage == "stage3":
      resumed += json.loads((out / "stage3_summary.json").read_text())["start_step"] > 0
    got = OUTPUTS[stage](out)
    for i, (g, w) in enumerate(zip(got, want)):
      assert g == w, f"{stage} trial {trial}: output {i} differs from the uninterrupted run's"
    identical += 1
  left = _leftover_segments(pids)
  print(f"\nFAULT MATRIX {stage}: {TRIALS} trials, {landed} kills landed, {identical} identical "
        f"outputs, {resumed} Stage 3 reruns resumed from a checkpoint after step 0, "
        f"uninterrupted warm run {wall:.1f} s after imports, stage total {time.time() - t0:.0f} s, "
        f"leftover segments {len(left)}")
  assert not left, left
  assert landed >= TRIALS // 2, f"{stage}: only {landed} of {TRIALS} kills landed before the end"
  assert stage != "stage3" or resumed >= 1, "no Stage 3 rerun resumed from a mid-run checkpoint"
