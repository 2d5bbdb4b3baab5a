"""Preemption: SIGTERM / SIGUSR1 make a stage save at the next step boundary and exit 0; the rerun
resumes exactly.

Stage 3 (`launch/train.py`, GRPO, the generation process in its own process, validation at step 0
and every 2 steps): SIGTERM sent mid-run to the command's whole process group (as SLURM signals a
job step); the resumed run's metrics, validation record and final exported weights equal an
uninterrupted run's, bit for bit. Stage 1 (quicker, in this process): SIGUSR1 arrives while the
first prompt batch is written; `run_stage1` returns ``preempted`` after that batch, and the rerun
labels the rest, keeping that batch (exact resume of Stage 1 after a kill:
tests/workflows/test_kill_resume.py). (SFT: tests/sft/test_baseline.py.)
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from disa_jax import models, testing
from disa_jax.estimators import dataset
from disa_jax.rl.metrics import read_jsonl
from disa_jax.workflows.stage1 import Stage1Config, run_stage1
from tests.workflows import test_kill_resume as kr
from tests.workflows.conftest import worker_env, write_dapo_parquet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
BOUND_S = 60.0  # signal -> exit 0 on these tiny runs (a step is well under a second)


def _summary(stdout: str) -> dict:
  """The JSON summary a launcher prints last (indented: its top-level brace starts a line)."""
  text = "\n" + stdout
  return json.loads(text[text.rindex("\n{") + 1:])


def _wait_for(predicate, proc, what, timeout=600):
  deadline = time.time() + timeout
  while not predicate():
    if proc.poll() is not None or time.time() > deadline:
      out, err = proc.communicate()
      raise AssertionError(f"{what}: the run ended or timed out first: {(out or '')[-2000:]} "
                           f"{(err or '')[-3000:]}")
    time.sleep(0.01)


def _signal_group(proc, sig):
  """Signals the command and every process it started (its session), as SLURM does; returns
  (stdout, stderr, seconds from the signal to exit)."""
  t0 = time.time()
  os.killpg(proc.pid, sig)
  out, err = proc.communicate(timeout=300)
  return out, err, time.time() - t0


def _run(cmd, env):
  out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  return out


def _stage3_cmd(tmp_path, workdir):
  ckpt = tmp_path / "model"
  if not ckpt.exists():
    testing.save_tiny_checkpoint(str(ckpt), family="qwen3")
  rows = [{"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "data_source": "toy",
           "ability": "math", "reward_model": {"ground_truth": str(2 * i)},
           "extra_info": {"index": i}} for i in range(6)]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]))
  (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[4:]))
  return [sys.executable, os.path.join(ROOT, "launch", "train.py"),
          "--config=" + os.path.join(ROOT, "configs", "stage3_paper.py") + ":grpo,qwen3-4b-base,math",
          f"--config.model.policy_path={ckpt}", "--config.model.dtype=float32",
          "--config.model.remat=False", f"--config.data.train_path={tmp_path / 'train.jsonl'}",
          f"--config.data.validation_paths=('{tmp_path / 'val.jsonl'}',)",
          "--config.data.rendering=plain",
          "--config.train.rollout.prompts_per_batch=2", "--config.train.rollout.group_size=2",
          "--config.train.rollout.max_response_len=4", "--config.train.rollout.max_prompt_len=128", "--config.train.rollout.num_minibatches=1",
          "--config.train.rollout.micro_batch_rows=4", "--config.engine.kind=jax",
          "--config.engine.separate_process=True", "--config.engine.dtype=float32",
          "--config.train.validation.every=2", "--config.train.validation.n=2",
          "--config.train.validation.max_tokens=4", "--config.train.checkpoint.every=4",
          "--config.train.checkpoint.keep=1", f"--config.train.total_steps={STEPS}",
          "--config.export_checkpoint=latest", "--config.train.tensorboard=False",
          "--config.train.progress_bar=False", f"--workdir={workdir}"]


def _strip(rows):
  return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
          for r in rows]


@pytest.mark.slow
def test_stage3_sigterm_mid_run_saves_exits_0_and_resumes_exactly(tmp_path):
  env = worker_env()
  ref = _summary(_run(_stage3_cmd(tmp_path, tmp_path / "ref"), env).stdout)
  assert ref["preempted"] is None and ref["export_checkpoint"]["step"] == STEPS

  work = tmp_path / "run"
  proc = subprocess.Popen(_stage3_cmd(tmp_path, work), env=env, cwd=ROOT, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  metrics = work / "metrics.jsonl"
  # step 0's validation row, then steps 1 and 2: the run is past the handler's installation
  _wait_for(lambda: metrics.exists() and len(read_jsonl(str(metrics))) >= 3, proc, "step 2")
  out, err, secs = _signal_group(proc, signal.SIGTERM)
  print(f"stage 3: SIGTERM -> exit {proc.returncode} in {secs:.1f} s")
  assert proc.returncode == 0, err[-4000:]
  assert secs < BOUND_S
  first = _summary(out)
  stopped = first["preempted"]
  assert 2 <= stopped < STEPS and first["export"] is None, first
  assert "received SIGTERM" in err and not (work / "final").exists()
  assert str(stopped) in os.listdir(work / "checkpoints")  # saved at the step it stopped at
  assert [r["step"] for r in read_jsonl(str(metrics))] == list(range(stopped + 1))

  second = _summary(_run(_stage3_cmd(tmp_path, work), env).stdout)
  assert second["preempted"] is None and second["start_step"] == stopped
  assert _strip(read_jsonl(str(metrics))) == _strip(read_jsonl(str(tmp_path / "ref" / "metrics.jsonl")))
  assert second["selection"] == ref["selection"] and len(ref["selection"]["scores"]) == 4
  want = models.read_checkpoint_tensors(str(tmp_path / "ref" / "final"))
  got = models.read_checkpoint_tensors(str(work / "final"))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
def test_stage1_sigusr1_stops_after_the_batch_in_flight_and_resumes(checkpoints, tmp_path,
                                                                     monkeypatch):
  prompts = write_dapo_parquet(str(tmp_path / "dapo.parquet"), kr.N_PROMPTS)

  write = dataset.Stage1Writer.write
  def write_then_signal(self, records):  # SIGUSR1 lands while the first batch is being written
    os.kill(os.getpid(), signal.SIGUSR1)
    return write(self, records)
  monkeypatch.setattr(dataset.Stage1Writer, "write", write_then_signal)
  cfg = Stage1Config.from_config(kr._stage1_config_dict(  # pylint: disable=protected-access
      checkpoints, prompts, tmp_path / "run", "jsonl"))
  first = run_stage1(cfg)
  assert first.preempted and first.run["prompts_done"] == 2, first
  written = kr._records(cfg)  # pylint: disable=protected-access
  assert len(written) == 2 and not (tmp_path / "run" / "stage1_summary.json").exists()
  monkeypatch.setattr(dataset.Stage1Writer, "write", write)
  second = run_stage1(cfg)
  assert not second.preempted and second.run["prompts_skipped"] == 2
  assert second.run["prompts_done"] == kr.N_PROMPTS - 2
  records = kr._records(cfg)  # pylint: disable=protected-access
  assert len(records) == kr.N_PROMPTS and all(records[p] == r for p, r in written.items())
