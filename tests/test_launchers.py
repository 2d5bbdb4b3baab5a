"""The launchers (`disa_jax.launcher`): any directory, one-line errors with exit code 2, and
`--dry_run`'s checks before any weights load (`disa_jax.workflows.preflight`), in subprocesses
as a user runs them (tests/test_user_errors.py runs the whole matrix of mistakes in-process)."""
import os
import subprocess
import sys
import time

import pytest

from configs import stage1_paper, stage3_paper
from disa_jax import launcher
from disa_jax.workflows.preflight import PreflightError, preflight
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage3 import Stage3Config
from tests.test_dry_run_commands import make_inputs
from tests.test_user_errors import error_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S3 = "configs/stage3_paper.py:disa,qwen3-4b-base,math"


def _launch(script, *args, cwd, devices=1):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), *args], env=env,
                        capture_output=True, text=True, timeout=300, cwd=cwd)


def _error_line(out):
  """The one stderr line of a refused command."""
  return error_line(out.returncode, out.stderr)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
  """A directory holding every input the paper's Stage 1 / Stage 3 configs name: the real models'
  config.json (tests/fixtures/model_configs/), empty prompt files, a matching anchor."""
  root = tmp_path_factory.mktemp("inputs")
  cwd = os.getcwd()
  os.chdir(root)
  try:
    make_inputs(Stage1Config.from_config(stage1_paper.get_config()))
    make_inputs(Stage3Config.from_config(stage3_paper.get_config(S3.split(":")[1])))
  finally:
    os.chdir(cwd)
  return root


def test_main_job_dry_run_from_another_directory(tmp_path):
  out = _launch("main.py", f"--workdir={tmp_path / 'w'}", "--dry_run", cwd=tmp_path)
  assert out.returncode == 0, out.stderr[-3000:]  # was: No such file 'configs/main.py'
  assert '"preset": "default"' in out.stdout


@pytest.mark.slow
def test_config_errors_are_one_line_with_exit_code_2(inputs):
  unknown = _error_line(_launch("train.py", f"--config={S3}", "--config.nonsense=1", "--dry_run",
                                cwd=inputs))
  assert "--config.nonsense" in unknown
  bad = _error_line(_launch("train.py", f"--config={S3}", "--config.train.rollout.group_size=0",
                            "--dry_run", cwd=inputs))
  assert "train.rollout.group_size" in bad and "got 0" in bad
  missing = _error_line(_launch("train.py", f"--config={S3}", "--dry_run",
                                "--config.model.policy_path=/no/such/Qwen3-4B", cwd=inputs))
  assert "model.policy_path='/no/such/Qwen3-4B': no such file or directory" in missing
  assert "Repo id" not in missing
  verbose = _launch("train.py", f"--config={S3}", "--config.nonsense=1", "--dry_run", "--verbose",
                    cwd=inputs)
  assert verbose.returncode != 0 and "Traceback" in verbose.stderr


@pytest.mark.slow
def test_dry_run_refuses_a_bad_mesh_in_seconds_and_names_the_fix(inputs):
  start = time.monotonic()
  line = _error_line(_launch("train.py", f"--config={S3}", "--config.mesh.fsdp=4", "--dry_run",
                             cwd=inputs, devices=6))
  elapsed = time.monotonic() - start
  assert "mesh.fsdp=4" in line and "6 present" in line and "mesh.fsdp=-1" in line
  print(f"--dry_run start to the bad-mesh error: {elapsed:.1f} s")
  assert elapsed < 60
  ok = _launch("train.py", f"--config={S3}", "--config.mesh.fsdp=6", "--workdir=w", "--dry_run",
               cwd=inputs, devices=6)
  assert ok.returncode == 0, ok.stderr[-3000:]
  assert "train.rollout.micro_batch_rows=8 -> 12 rows per micro-batch" in ok.stderr


def test_preflight_lengths_paths_and_anchor(inputs, monkeypatch):
  monkeypatch.chdir(inputs)
  arg = S3.split(":")[1]
  notes = preflight(Stage3Config.from_config(stage3_paper.get_config(arg)))  # the paper values fit
  assert any("vLLM ends a response there" in n for n in notes), notes  # 2048 + 32768 > 32768
  c = stage3_paper.get_config(arg)
  c.engine.vllm_kwargs.max_model_len = 18432  # main's value: validation at 32768 does not fit
  with pytest.raises(PreflightError, match=r"train.rollout.max_prompt_len \+ train.validation."
                     r"max_tokens = 34816 > engine.vllm_kwargs.max_model_len=18432; set "
                     r"engine.vllm_kwargs.max_model_len=32768"):  # the model's context
    preflight(Stage3Config.from_config(c))
  c = stage3_paper.get_config(arg)
  c.train.objective.beta = 3.0  # the anchor was fitted with the config's beta
  with pytest.raises(PreflightError, match="data.anchor_path=.*beta"):
    preflight(Stage3Config.from_config(c))
  s1 = stage1_paper.get_config()
  s1.engine.vllm_kwargs.max_model_len = 300000  # beyond the 235B proposal's 262144 positions
  with pytest.raises(PreflightError, match="the context of proposal_path="):
    preflight(Stage1Config.from_config(s1))
  s1 = stage1_paper.get_config()
  s1.prompts_path = "data/none.parquet"
  with pytest.raises(PreflightError, match="prompts_path='data/none.parquet': no such file"):
    preflight(Stage1Config.from_config(s1))


def test_relative_config_paths_resolve_from_the_repository(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert launcher.resolve_config_arg(f"--config={S3}") == (
      f"--config={os.path.join(ROOT, 'configs/stage3_paper.py')}:{S3.split(':')[1]}")
  assert launcher.resolve_config_arg("--config=nowhere.py") == "--config=nowhere.py"
  assert launcher.resolve_config_arg("--workdir=configs") == "--workdir=configs"
