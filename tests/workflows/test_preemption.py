"""Preemption: SIGTERM / SIGUSR1 make a stage save at the next step boundary and exit 0; the rerun
resumes exactly.

Stage 3 (`launch/train.py`, GRPO, the generation process in its own process, validation at step 0
and every 2 steps): SIGTERM sent mid-run to the command's whole process group (as SLURM signals a
job step); the resumed run's metrics, validation record and final exported weights equal an
uninterrupted run's, bit for bit. Stage 1 (quicker, in this process): SIGUSR1 arrives while the
first prompt batch is written; `run_stage1` returns ``preempted`` after that batch, and the rerun
labels the rest, keeping that batch (exact resume of Stage 1 after a kill:
tests/workflows/test_kill_resume.py). (SFT: tests/sft/test_baseline.py.)

Stage 2 and evaluation through their commands (issue 65): SIGTERM mid-run, exit 0 with one
``preempted`` line after saving (Stage 2: its embedding pass; evaluation: the graded rows of the
problems done), and the rerun's anchor / benchmark results equal an uninterrupted run's. A SIGTERM
while a command parses its flags exits 0 with one line, no traceback.
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
from tests.workflows.conftest import worker_env, write_dapo_parquet, write_prompt_files
from tests.workflows.test_workflow_units import write_stage1_run

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


def _config_file(path, module, arg, values):
  """A user's config file: ``configs/<module>.py:<arg>`` with the dotted fields of ``values`` set."""
  path.write_text(f"""from configs import {module}


def get_config():
  c = {module}.get_config({arg!r})
  for key, value in {values!r}.items():
    *head, last = key.split(".")
    section = c
    for name in head:
      section = section[name]
    section[last] = value
  return c
""")
  return str(path)


def _command(script, config):
  return [sys.executable, os.path.join(ROOT, "launch", script), f"--config={config}"]


def _sigterm_once(cmd, ready, what):
  """Runs ``cmd``, SIGTERMs it once ``ready()``; its (stdout, stderr) after it exited 0."""
  proc = subprocess.Popen(cmd, env=worker_env(), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, start_new_session=True)
  _wait_for(ready, proc, what)
  out, err, secs = _signal_group(proc, signal.SIGTERM)
  assert proc.returncode == 0 and "Traceback" not in err, (proc.returncode, err[-4000:])
  assert secs < BOUND_S, secs
  return out, err


def _stage2_values(checkpoints, stage1_path, out):
  return {"stage1_path": stage1_path, "reference_path": checkpoints["reference"],
          "anchor_path": str(out / "anchor"), "output_dir": str(out / "s2"), "fit.epochs": 3,
          "fit.batch_size": 4, "fit.val_fraction": 0.34, "embedding.dtype": "float32",
          "embedding.batch_size": 2, "embedding.pad_to": 16, "embedding.mesh.num_devices": 1}


@pytest.mark.slow  # three tiny Stage 2 commands (~15 s each on 2 cores)
def test_stage2_sigterm_saves_the_embedding_pass_exits_0_and_the_rerun_fits_the_same_anchor(
    checkpoints, tmp_path):
  samples = [[{"token_ids": [7, 8], "text": "ab", "logp_ref": -2.0 - j - i, "logp_proposal": -2.5,
               "reward": float(j % 2), "num_tokens": 2} for j in range(3)] for i in range(6)]
  stage1_path, _ = write_stage1_run(tmp_path, checkpoints["reference"], samples)
  ref_cfg = _config_file(tmp_path / "ref_cfg.py", "stage2_paper", "qwen3-4b-base,math",
                         _stage2_values(checkpoints, stage1_path, tmp_path / "ref"))
  ref = _summary(_run(_command("stage2.py", ref_cfg), worker_env()).stdout)

  out = tmp_path / "run"
  cfg = _config_file(tmp_path / "cfg.py", "stage2_paper", "qwen3-4b-base,math",
                     _stage2_values(checkpoints, stage1_path, out))
  # the identity file is written once the handler is installed, before the embedding pass
  _, err = _sigterm_once(_command("stage2.py", cfg),
                         lambda: (out / "s2" / "stage2_identity.json").exists(), "Stage 2's claim")
  assert [l for l in err.splitlines() if l.startswith("stage2: preempted (SIGTERM)")], err[-3000:]
  assert (out / "s2" / "embeddings.npy").exists() and not (out / "anchor").exists()
  again = _summary(_run(_command("stage2.py", cfg), worker_env()).stdout)
  for key in ("fit", "label_stats", "sigma_g_train", "sigma_g_val", "val_prompt_ids"):
    assert again[key] == ref[key], key
  np.testing.assert_array_equal(np.load(out / "s2" / "embeddings.npy"),
                                np.load(tmp_path / "ref" / "s2" / "embeddings.npy"))


def _eval_values(checkpoints, benchmark, out):
  return {"model_path": checkpoints["proposal"], "output_dir": str(out), "label": "tiny",
          "benchmarks": {"math500": benchmark}, "math_k": 2, "max_tokens": 24, "save_every": 1,
          "engine.kind": "jax", "engine.dtype": "float32", "engine.separate_process": False}


@pytest.mark.slow  # three tiny evaluation commands (~15 s each on 2 cores)
def test_evaluation_sigterm_keeps_the_graded_rows_exits_0_and_the_rerun_resumes_exactly(
    checkpoints, tmp_path):
  benchmark = write_prompt_files(tmp_path)["math500"]
  rows = [json.loads(l) for l in open(os.path.join(os.path.dirname(benchmark), "math500.jsonl"))]
  with open(benchmark, "w") as f:  # six problems: the two of the fixture, three times
    f.write("".join(json.dumps(dict(r, unique_id=f"{r.get('unique_id', i)}-{c}")) + "\n"
                    for c in range(3) for i, r in enumerate(rows)))
  ref_cfg = _config_file(tmp_path / "ref_cfg.py", "eval_paper", "math",
                         _eval_values(checkpoints, benchmark, tmp_path / "ref"))
  _run(_command("evaluate.py", ref_cfg), worker_env())

  out = tmp_path / "run"
  cfg = _config_file(tmp_path / "cfg.py", "eval_paper", "math",
                     _eval_values(checkpoints, benchmark, out))
  responses = out / "math500_responses.jsonl"
  _, err = _sigterm_once(_command("evaluate.py", cfg),
                         lambda: responses.exists() and responses.read_text().count("\n") >= 1,
                         "the first graded row")
  assert [l for l in err.splitlines() if l.startswith("evaluate: preempted (SIGTERM) in benchmark "
                                                       "'math500'")], err[-3000:]
  kept = responses.read_text().splitlines()
  assert 1 <= len(kept) < 6 and not (out / "math500.json").exists(), len(kept)
  _run(_command("evaluate.py", cfg), worker_env())
  assert responses.read_text().splitlines()[:len(kept)] == kept  # the saved rows were kept
  assert responses.read_text() == (tmp_path / "ref" / "math500_responses.jsonl").read_text()
  got, want = (json.loads((d / "math500.json").read_text()) for d in (out, tmp_path / "ref"))
  assert got["metrics"] == want["metrics"] and got["per_prompt"] == want["per_prompt"]


@pytest.mark.slow  # the command's imports (~10 s on 2 cores)
def test_sigterm_while_the_flags_parse_exits_0_in_one_line(tmp_path):
  """Every command parses its flags through `launcher.define_flags`; Stage 2's is tried."""
  config = tmp_path / "cfg.py"  # a config file that is being read when the SIGTERM arrives
  config.write_text("import os, signal, time\n\n\ndef get_config():\n"
                    "  os.kill(os.getpid(), signal.SIGTERM)\n  time.sleep(30)\n"
                    "  raise AssertionError('the SIGTERM was not acted on')\n")
  out = subprocess.run(_command("stage2.py", config), env=worker_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0 and out.stderr.strip().splitlines() == [
      "preemption: received SIGTERM before the run began; nothing to save, exiting 0"], out
