"""Every user mistake, in every entry point, is one ``error: ...`` line on stderr and exit code 2.

One matrix of mistakes x entry points (launch/*.py, main.py, offline.py, prepare_data.py,
multihost.py and split_validation.py included), each run in this process through
`disa_jax.launcher.invoke` (the launch script itself, with its own absl flags), plus the checks a
first run meets before any weights load: a rerun's identity under --dry_run, naming `overwrite`;
an offline hub source; the output printed by process 0 only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from disa_jax import launcher
from disa_jax.checkpoint.files import OutputWriteError
from disa_jax.checkpoint.identity import IdentityMismatchError
from disa_jax.workflows import evaluation
from disa_jax.workflows.stage3 import claim_stage3_output
from tests.test_dry_run_commands import make_inputs, typed_config

ROOT = Path(__file__).resolve().parents[1]
S3 = "--config=configs/stage3_paper.py:disa,qwen3-4b-base,math"
S1 = "--config=configs/stage1_paper.py:qwen3-4b-base,math"
SPLIT = ["--train=t.parquet", "--validation=v.parquet", "--seed=0"]
# (id, script, argv, environment, what the error line must say)
MISTAKES = [
    ("main-misspelt-field", "main", ["--workdir=w", "--config.train.total_step=5"], {},
     ["--config.train.total_step", "total_steps"]),
    ("main-readonly-workdir", "main", ["--workdir=/proc/disa_main"], {},
     ["--workdir='/proc/disa_main'", "cannot write in /proc"]),
    ("offline-unknown-field", "offline", ["--workdir=w", "--config.nonsense=1"], {},
     ["--config.nonsense"]),
    ("train-misspelt-method", "train", ["--config=configs/stage3_paper.py:dsia,qwen3-4b-base,math"],
     {}, ["ValueError: config METHOD must be one of", "got 'dsia'"]),
    ("train-not-a-number", "train", [S3, "--config.train.total_steps=fifty"], {},
     ["--config.train.total_steps=fifty"]),
    ("train-misspelt-field", "train", [S3, "--config.train.total_step=50"], {},
     ["--config.train.total_step: 'total_step' Did you mean \"total_steps\""]),
    ("train-bad-choice", "train", [S3, "--config.engine.kind=vlm"], {}, ["got 'vlm'"]),
    ("train-wrong-type", "train", [S3, "--config.train.rollout.group_size=abc"], {},
     ["--config.train.rollout.group_size=abc"]),
    ("train-readonly-workdir", "train", [S3, "--workdir=/proc/disa_run"], {},
     ["workdir='/proc/disa_run'", "cannot write in /proc"]),
    ("train-no-workdir", "train", [S3], {}, ["workdir: not set"]),
    ("train-stray-argument", "train", [S3, "--workdir=w", "stray"], {},
     ["unexpected arguments: ['stray']"]),
    ("stage1-no-config", "stage1", [], {}, ["--config"]),
    ("stage1-output-under-a-file", "stage1", [S1, "--config.output_dir=a_file/out"], {},
     ["output_dir='a_file/out'", "a_file is a file, not a directory"]),
    ("stage2-short-config-string", "stage2", ["--config=configs/stage2_paper.py:qwen3-4b-base"], {},
     ["config string must be BACKBONE,TASK"]),
    ("sft-wrong-type", "sft", ["--config=configs/sft_paper.py:qwen3-4b-base",
                               "--config.sft.rank=sixty"], {}, ["--config.sft.rank=sixty"]),
    ("evaluate-no-output", "evaluate", ["--config=configs/eval_paper.py:math"], {},
     ["output_dir is required"]),
    ("nstudy-misspelt-field", "nstudy", ["--config=configs/nstudy_paper.py:qwen3-4b-base,math",
                                         "--config.pool_sise=4"], {}, ["--config.pool_sise"]),
    ("prepare-unknown-set", "prepare_data", ["--set=gsm8k"], {}, ["--set", "gsm8k"]),
    ("prepare-no-set", "prepare_data", [], {}, ["--set"]),
    ("prepare-missing-local-source", "prepare_data", ["--set=math500", "--source=./dl/MATH-500"],
     {}, ["source='./dl/MATH-500': no such file or directory"]),
    ("split-not-a-number", "split_validation", ["--input=p.jsonl", *SPLIT, "--size=abc"], {},
     ["--size"]),
    ("split-missing-input", "split_validation", ["--input=none.jsonl", *SPLIT, "--size=5"], {},
     ["--input='none.jsonl': no such file"]),
    ("multihost-unknown-module", "multihost", ["launch.trian", S3], {},
     ["'launch.trian' not found"]),
    ("multihost-no-module", "multihost", [], {}, ["missing the entry module"]),
    ("multihost-bad-variable", "multihost", ["launch.train", S3],
     {"DISA_COORDINATOR": "localhost:1", "DISA_NUM_PROCESSES": "two", "DISA_PROCESS_ID": "0"},
     ["DISA_NUM_PROCESSES='two' is not an integer"]),
    ("multihost-bad-heartbeat", "multihost", ["launch.train", S3],
     {"DISA_COORDINATOR": "localhost:1", "DISA_NUM_PROCESSES": "2", "DISA_PROCESS_ID": "0",
      "DISA_HEARTBEAT_TIMEOUT_S": "soon"},
     ["DISA_HEARTBEAT_TIMEOUT_S='soon' must be a number of seconds > 2"]),
]
# NaN / +-inf in a float of every stage's config, typed or in an open section (`engine.vllm_kwargs`
# took them until `codec.refuse_nonfinite`): one line naming the dotted field and the value.
NONFINITE = [
    ("stage1", [S1], "beta", "inf"),
    ("stage1", [S1], "engine.vllm_kwargs.gpu_memory_utilization", "inf"),
    ("stage2", ["--config=configs/stage2_paper.py:qwen3-4b-base,math"], "fit.val_fraction", "nan"),
    ("train", [S3, "--workdir=w"], "train.objective.beta", "nan"),
    ("train", [S3, "--workdir=w"], "engine.vllm_kwargs.gpu_memory_utilization", "-inf"),
    ("sft", ["--config=configs/sft_paper.py:qwen3-4b-base"], "sft.grad_clip", "inf"),
    ("evaluate", ["--config=configs/eval_paper.py:math"], "temperature", "nan"),
    ("nstudy", ["--config=configs/nstudy_paper.py:qwen3-4b-base,math"], "stage1.beta", "inf"),
    ("main", ["--workdir=w"], "beta", "nan"),
    ("main", ["--workdir=w"], "engine.vllm_kwargs.gpu_memory_utilization", "inf"),
    ("offline", ["--workdir=w"], "problem.proposal_mix", "-inf"),
]
MISTAKES += [(f"{script}-{field}-{value}", script, [*argv, f"--config.{field}={value}"], {},
              [f"config.{field} must be a finite number, got {float(value)!r}"])
             for script, argv, field, value in NONFINITE]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """A working directory holding every input of the paper's Stage 1 / Stage 3 configs."""
  root = tmp_path_factory.mktemp("inputs")
  cwd = os.getcwd()
  os.chdir(root)
  try:
    for script, argv in (("train", [S3]), ("stage1", [S1])):
      make_inputs(typed_config(script, argv))
    Path("a_file").write_text("not a directory\n")
    Path("p.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
  finally:
    os.chdir(cwd)
  return root


def _run(script, argv, capfd):
  capfd.readouterr()
  rc = launcher.invoke(str(ROOT / "launch" / f"{script}.py"), argv)
  return rc, *capfd.readouterr()


def error_line(rc, err):
  """The one stderr line of a refused command."""
  assert rc == 2, err[-3000:]
  lines = [l for l in err.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
  return lines[0]


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_a_mistake_is_one_line_and_exit_code_2(mistake, inputs, monkeypatch, capfd):
  _, script, argv, env, says = mistake
  monkeypatch.chdir(inputs)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  rc, _, err = _run(script, argv + (["--dry_run"] if script not in ("multihost",) else []), capfd)
  line = error_line(rc, err)
  assert "Traceback" not in err
  for text in says:
    assert text in line, line


def test_verbose_gives_the_traceback(inputs, monkeypatch, capfd):
  monkeypatch.chdir(inputs)
  with pytest.raises((KeyError, AttributeError)):
    launcher.invoke(str(ROOT / "launch" / "train.py"),
                    [S3, "--config.train.total_step=50", "--dry_run", "--verbose"])


def test_a_rerun_with_other_settings_stops_at_the_dry_run(inputs, monkeypatch, capfd):
  """Issue 43 #5: a workdir rerun with another lr, refused by --dry_run naming the field and
  `overwrite`, before any weights load; the dry run writes nothing."""
  monkeypatch.chdir(inputs)
  workdir = inputs / "runs" / "resumed"
  claim_stage3_output(typed_config("train", [S3, f"--workdir={workdir}"]))  # the first run's claim
  (workdir / "checkpoints").mkdir()  # ... and its first checkpoint
  before = sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
  rc, _, err = _run("train", [S3, f"--workdir={workdir}", "--config.train.optim.lr=2e-6",
                              "--dry_run"], capfd)
  line = error_line(rc, err)
  assert "train.optim.lr: stored 1e-06, this run 2e-06" in line and "overwrite=True" in line, line
  assert str(workdir / "identity.json") in line
  after = sorted((p.relative_to(workdir), p.stat().st_mtime_ns) for p in workdir.rglob("*"))
  assert after == before  # nothing written, nothing discarded
  rc, out, err = _run("train", [S3, f"--workdir={workdir}", "--dry_run"], capfd)
  assert rc == 0, err[-3000:]  # the same settings resume
  rc, out, err = _run("train", [S3, f"--workdir={workdir}", "--config.train.optim.lr=2e-6",
                                "--config.overwrite=True", "--dry_run"], capfd)
  assert rc == 0, err[-3000:]  # overwrite=True will discard them: nothing to refuse
  assert (workdir / "checkpoints").is_dir()


def test_an_evaluation_rerun_is_checked_benchmark_by_benchmark(inputs, monkeypatch, capfd):
  """The evaluation's identity is per benchmark: each one's is checked by --dry_run."""
  monkeypatch.chdir(inputs)
  for name in ("aime24", "math500"):
    Path(f"data/{name}.jsonl").write_text(json.dumps({"problem": "p", "answer": "1"}) + "\n")
  argv = ["--config=configs/eval_paper.py:math", "--config.model_path=models/Qwen3-4B-Base",
          "--config.output_dir=eval/q3", "--config.benchmarks.aime24=data/aime24.jsonl",
          "--config.benchmarks.math500=data/math500.jsonl", "--config.benchmarks.aime25=",
          "--config.benchmarks.amc23=", "--config.benchmarks.minerva=",
          "--config.benchmarks.olympiadbench="]
  cfg = typed_config("evaluate", argv)
  evaluation._claim_benchmarks(cfg, cfg.model_path, Path(cfg.output_dir))  # the first run's claims
  Path("eval/q3/math500.json").write_text("{}")  # ... and its second benchmark's result
  rc, _, err = _run("evaluate", [*argv, "--config.temperature=0.7", "--dry_run"], capfd)
  line = error_line(rc, err)
  assert "temperature: stored 0.6, this run 0.7" in line and "math500.identity.json" in line, line
  assert "overwrite=True" in line
  rc, _, err = _run("evaluate", [*argv, "--dry_run"], capfd)
  assert rc == 0, err[-3000:]


@pytest.mark.parametrize("env, prints", [
    ({}, True),
    ({"DISA_COORDINATOR": "localhost:1", "DISA_NUM_PROCESSES": "3", "DISA_PROCESS_ID": "1"}, False),
    ({"SLURM_NTASKS": "3", "SLURM_PROCID": "2", "SLURM_STEP_NODELIST": "node1"}, False),
    ({"SLURM_NTASKS": "3", "SLURM_PROCID": "0", "SLURM_STEP_NODELIST": "node1"}, True),
], ids=["single", "env-process-1", "slurm-task-2", "slurm-task-0"])
def test_only_process_0_prints(env, prints, inputs, monkeypatch, capfd):
  """Issue 43 #9: a 3-task run prints its config (and result, and notes) once."""
  monkeypatch.chdir(inputs)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  rc, out, err = _run("stage1", [S1, "--dry_run"], capfd)  # no jax.distributed in its convert
  assert rc == 0, err[-3000:]
  assert bool(out.strip()) == prints and (not prints or json.loads(out)["output_dir"])


def test_an_offline_hub_source_fails_in_seconds_with_the_way_out(tmp_path):
  """Issue 43 #6: no retries; the error names --source (and the cache) in one line."""
  offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")  # tests/conftest.py's
  env = {k: v for k, v in os.environ.items() if k not in offline}
  env.update(HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  start = time.monotonic()
  out = subprocess.run([sys.executable, str(ROOT / "launch" / "prepare_data.py"), "--set=math500"],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
  line = error_line(out.returncode, out.stderr)
  assert "source='HuggingFaceH4/MATH-500' is a Hugging Face hub name" in line, line
  assert "pass --source=" in line and "HF_HUB_OFFLINE=1" in line, line
  assert time.monotonic() - start < 30  # the imports; the probe itself fails at once
  assert not list(tmp_path.rglob("*.jsonl"))



@pytest.mark.parametrize("error, shown", [
    (OutputWriteError(28, "No space left on device (writing the Stage 1 dataset part)", "/d/p.tmp"),
     "No space left on device (writing the Stage 1 dataset part): '/d/p.tmp'"),
    (IdentityMismatchError(Path("/w/identity.json"), {"lr": (1e-6, 0.5)}),
     "/w holds outputs of a run with other inputs (1 field(s) differ")])
def test_a_run_time_output_error_is_one_line_and_exit_code_2(error, shown, capfd):
  """Past the start-up checks (``started()`` true) a generic error is the run's own and keeps its
  traceback, but a full or read-only disk or another run's outputs are the user's: one line."""
  with pytest.raises(SystemExit) as e:
    with launcher.user_errors([], started=lambda: True):
      raise error
  assert e.value.code == 2
  err = capfd.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: ") and shown in err[0], err
  with pytest.raises(ValueError, match="a bug"):  # a run's own error keeps its traceback
    with launcher.user_errors([], started=lambda: True):
      raise ValueError("a bug")
