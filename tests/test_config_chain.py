"""Every experiment of configs/README.md chains: Stage 1 output -> Stage 2 input -> Stage 3 / SFT.

The README is the source: its config strings (with {a,b} alternatives expanded) are built with
the same conversion the commands use, and each Stage 3 / SFT run must find the Stage 1 dataset and
Stage 2 anchor its README line implies, with the same reference and label facts. One chain also
goes through the command lines' ``--dry_run``.
"""
import itertools
import json
import os
import re
import subprocess
import sys

import pytest

from configs import sft_paper, stage1_paper, stage2_paper, stage3_paper
from disa_jax.workflows.sft import SftConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config
from disa_jax.workflows.stage3 import Stage3Config
from tests.test_dry_run_commands import make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "configs", "README.md")).read()


def _expand(arg: str) -> list[str]:
  parts = re.split(r"(\{[^}]*\})", arg)
  choices = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
  return ["".join(c) for c in itertools.product(*choices)]


def _strings(config: str) -> list[str]:
  found = re.findall(rf"`configs/{config}\.py:([^`\s]+)`", README)
  # Usage lines (METHOD,BACKBONE,...) are templates, not experiments.
  return sorted({s for f in found if not re.search(r"[A-Z\[]", f) for s in _expand(f)})


STAGE1 = _strings("stage1_paper")
STAGE3 = _strings("stage3_paper")
SFT = _strings("sft_paper")


def _stage1_string(stage3_arg: str) -> str:
  method, backbone, task, *opts = stage3_arg.split(",")
  del method
  keep = [o for o in opts if not o.startswith(("replay=", "variant="))]
  return ",".join([backbone, task] + keep)


def test_the_readme_lists_every_paper_experiment():
  assert len(STAGE3) >= 16 + 1 + 3 + 2 + 8 and len(SFT) == 2 and len(STAGE1) >= 8
  for arg in STAGE1:  # every Stage 1 line builds, and Stage 2 of the same string too
    Stage1Config.from_config(stage1_paper.get_config(arg))
    Stage2Config.from_config(stage2_paper.get_config(arg))


@pytest.mark.parametrize("arg", STAGE3)
def test_stage3_reads_what_stages_1_and_2_write(arg):
  s3 = Stage3Config.from_config(stage3_paper.get_config(arg))
  obj = s3.train.objective
  if not (obj.needs_anchor or s3.train.replay.enabled):
    return
  s1_arg = _stage1_string(arg)
  assert s1_arg in STAGE1, f"{arg} needs Stage 1 {s1_arg!r}, which configs/README.md does not list"
  s1 = Stage1Config.from_config(stage1_paper.get_config(s1_arg))
  s2 = Stage2Config.from_config(stage2_paper.get_config(s1_arg))
  assert s2.stage1_path == str(s1.dataset_path())
  assert s1.reference_path == s2.reference_path == s3.model.reference
  assert s1.rendering == s3.data.rendering
  assert (s1.beta, s1.label_scale, s1.reward_transform) == (obj.beta, obj.scale, obj.reward_transform)
  if obj.needs_anchor:
    assert s3.data.anchor_path == s2.anchor_path
  if s3.train.replay.enabled:
    assert s3.data.replay_path == str(s1.dataset_path())


@pytest.mark.parametrize("arg", SFT)
def test_sft_reads_the_math_stage1_data(arg):
  sft = SftConfig.from_config(sft_paper.get_config(arg))
  s1_arg = f"{arg},math"
  assert s1_arg in STAGE1
  s1 = Stage1Config.from_config(stage1_paper.get_config(s1_arg))
  assert sft.stage1_path == str(s1.dataset_path()) and sft.reference_path == s1.reference_path


def _dry_run(script: str, config: str, cwd, *flags: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), f"--config={config}",
                        *flags, "--dry_run"], env=env, capture_output=True, text=True, timeout=300,
                       cwd=cwd)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout)


@pytest.mark.slow
def test_dry_runs_of_the_commands_print_the_same_chain(tmp_path, monkeypatch):
  arg = "qwen3-4b-base,math,impl=paper"
  # --dry_run checks the inputs: the real models' config.json at the paths the paper configs name.
  monkeypatch.chdir(tmp_path)
  stage1 = Stage1Config.from_config(stage1_paper.get_config(arg))
  make_inputs(stage1)
  (tmp_path / SftConfig.from_config(sft_paper.get_config("qwen3-4b-base")).stage1_path).mkdir(
      parents=True, exist_ok=True)  # the SFT default reads the non-'impl=paper' Stage 1 run
  # Each stage's output is made (as the stage would) after its own dry run: a dry run refuses
  # outputs without their identity file, as the run would.
  s1 = _dry_run("stage1.py", f"configs/stage1_paper.py:{arg}", tmp_path)
  stage1.dataset_path().mkdir(parents=True)  # Stage 2's input: Stage 1's output
  s2 = _dry_run("stage2.py", f"configs/stage2_paper.py:{arg}", tmp_path)
  make_inputs(Stage3Config.from_config(stage3_paper.get_config(f"disa,{arg}")))  # the anchor
  s3 = _dry_run("train.py", f"configs/stage3_paper.py:disa,{arg}", tmp_path, "--workdir=run")
  sft = _dry_run("sft.py", "configs/sft_paper.py:qwen3-4b-base", tmp_path)
  assert s2["stage1_path"] == os.path.join(s1["output_dir"], "stage1")
  assert s3["data"]["anchor_path"] == s2["anchor_path"]
  assert s3["train"]["objective"]["scale"] == s1["label_scale"] == "sum"
  assert sft["stage1_path"].startswith("stage1/qwen3-4b-base_math_")
