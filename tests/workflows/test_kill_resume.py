"""kill -9 in Stage 1 and Stage 2, then a rerun: nothing is lost and the result is the
uninterrupted run's (Stage 1: the same samples, rewards and labels per prompt; Stage 2: the same
anchor, predictions equal).

The kills are deterministic (`kill_worker.py` SIGKILLs itself at a named point: between Stage 1
batches, in the middle of writing a batch, at a training epoch of the anchor fit, in the middle of
saving the anchor) plus one kill from outside of `launch/stage1.py` after a listed-seed delay. Every
run is a fresh process with one CPU device (the workers forked by the module's fork server after
the imports, `conftest.fork_server`; the command a process of its own), on the tiny checkpoints of
`conftest.py` and the made-up DAPO-style prompts (6 prompts, 2 per batch, N = 4).
"""
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from ml_collections import ConfigDict

from configs import stage1_paper, stage2_paper
from disa_jax.anchor import Anchor
from disa_jax.estimators import load_stage1
from disa_jax import config as typed_config
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config
from tests.workflows.conftest import worker_env, write_dapo_parquet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_PROMPTS = 6

pytestmark = pytest.mark.slow


def _stage1_config_dict(ckpts, prompts_path, out_dir, fmt) -> ConfigDict:
  c = stage1_paper.get_config("qwen3-4b-base,math")
  c.reference_path, c.proposal_path = ckpts["reference"], ckpts["proposal"]
  c.prompts_path, c.output_dir, c.dataset_format = prompts_path, str(out_dir), fmt
  c.reward, c.reward_plugins = "toy_contains", ("tests.workflows.toy_reward",)
  c.sampling.n, c.sampling.max_tokens, c.sampling.seed = 4, 12, 3
  c.engine.kind, c.engine.dtype, c.engine.separate_process = "jax", "float32", False
  c.scorer.dtype, c.scorer.batch_size, c.scorer.pad_to = "float32", 8, 32
  c.prompts_per_batch, c.progress = 2, False
  return c


def _stage2_config(ckpts, stage1_path, out_dir) -> Stage2Config:
  c = stage2_paper.get_config("qwen3-4b-base,math")
  c.stage1_path, c.reference_path = str(stage1_path), ckpts["reference"]
  c.anchor_path, c.output_dir = str(out_dir / "anchor"), str(out_dir / "s2")
  c.fit.epochs, c.fit.batch_size, c.fit.val_fraction = 6, 2, 0.34
  c.embedding.dtype, c.embedding.batch_size, c.embedding.pad_to = "float32", 4, 32
  return Stage2Config.from_config(c)


def _worker(stage, cfg, point, server, expect_kill):
  """Runs ``stage`` on ``cfg`` in a worker forked by the module's fork server (kill ``point``):
  its (return code, stdout, stderr)."""
  with tempfile.TemporaryDirectory() as d:
    out_path, err_path = os.path.join(d, "stdout"), os.path.join(d, "stderr")
    proc = server.start(stage, typed_config.to_dict(cfg), point, out_path, err_path)
    proc.wait(timeout=900)
    out = subprocess.CompletedProcess(stage, proc.returncode, Path(out_path).read_text(),
                                      Path(err_path).read_text())
  if expect_kill:
    assert out.returncode == -signal.SIGKILL, (point, out.returncode, out.stderr[-4000:])
    return out
  last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
  if out.returncode != 0 and last.startswith("FileExistsError:"):
    raise FileExistsError(last)  # the run refused to resume (see the xfail below)
  assert out.returncode == 0, (point, out.stderr[-4000:])
  return out


def _records(cfg: Stage1Config):
  data = load_stage1(cfg.dataset_path(), cfg.dataset_format)
  return {r["prompt_id"]: r for r in data.records}


def _assert_same_stage1(got, want, n_prompts=N_PROMPTS):
  """Per prompt: the same samples (tokens, texts, rewards) and labels, bit for bit."""
  assert sorted(got) == sorted(want) and len(want) == n_prompts
  for pid, w in want.items():
    g = got[pid]
    assert g["prompt"] == w["prompt"]
    assert [s["token_ids"] for s in g["samples"]] == [s["token_ids"] for s in w["samples"]], pid
    assert [s["reward"] for s in g["samples"]] == [s["reward"] for s in w["samples"]], pid
    for key in ("logp_ref", "logp_proposal"):
      np.testing.assert_array_equal([s[key] for s in g["samples"]],
                                    [s[key] for s in w["samples"]], err_msg=f"{pid} {key}")
    for key in ("log_z_is", "log_z_gm", "ess", "cv2", "max_weight_share"):
      np.testing.assert_array_equal(g[key], w[key], err_msg=f"{pid} {key}")


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory, fork_server):
  root = tmp_path_factory.mktemp("kill_resume")
  return {"root": root, "ckpts": checkpoints, "env": worker_env(), "server": fork_server,
          "prompts": write_dapo_parquet(str(root / "dapo_tiny.parquet"), N_PROMPTS), "refs": {}}


def _reference_stage1(setup, fmt):
  """The uninterrupted Stage 1 run (one per dataset format, computed once)."""
  if fmt not in setup["refs"]:
    c = _stage1_config_dict(setup["ckpts"], setup["prompts"], setup["root"] / f"ref_{fmt}", fmt)
    cfg = Stage1Config.from_config(c)
    _worker("stage1", cfg, "none", setup["server"], expect_kill=False)
    setup["refs"][fmt] = (cfg, _records(cfg))
  return setup["refs"][fmt]


@pytest.mark.parametrize("fmt,point", [("jsonl", "after_write:1"), ("jsonl", "mid_write:2"),
                                       ("parquet", "mid_write:2")])
def test_stage1_killed_then_rerun_gives_the_same_labels(setup, tmp_path, fmt, point):
  _, want = _reference_stage1(setup, fmt)
  cfg = Stage1Config.from_config(_stage1_config_dict(setup["ckpts"], setup["prompts"],
                                                     tmp_path / "s1", fmt))
  _worker("stage1", cfg, point, setup["server"], expect_kill=True)
  done = 2 * int(point.split(":")[1]) - (2 if point.startswith("mid") else 0)
  assert cfg.dataset_path().exists()
  if point.startswith("mid") and fmt == "jsonl":
    assert not cfg.dataset_path().read_bytes().endswith(b"\n")  # a cut line was left behind
  out = _worker("stage1", cfg, "none", setup["server"], expect_kill=False)
  run = json.loads(out.stdout.split("SUMMARY ", 1)[1])["run"]
  assert run["prompts_skipped"] >= done and run["prompts_done"] == N_PROMPTS - run["prompts_skipped"]
  _assert_same_stage1(_records(cfg), want)


def _flat(c, prefix=""):
  out = {}
  for k, v in c.items():
    if isinstance(v, ConfigDict):
      out.update(_flat(v, f"{prefix}{k}."))
    elif isinstance(v, tuple):
      out[f"{prefix}{k}"] = repr(v)
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize("seed", [7])
def test_stage1_command_killed_from_outside_then_rerun(setup, tmp_path, seed):
  """`launch/stage1.py` killed -9 from outside after its first batch plus a listed-seed delay
  (24 prompts, so that 11 batches are left to cut into), then rerun by the same command."""
  n = 24
  prompts = write_dapo_parquet(str(tmp_path / "dapo_24.parquet"), n)
  ref_cfg = Stage1Config.from_config(_stage1_config_dict(setup["ckpts"], prompts, tmp_path / "ref",
                                                         "jsonl"))
  _worker("stage1", ref_cfg, "none", setup["server"], expect_kill=False)
  c = _stage1_config_dict(setup["ckpts"], prompts, tmp_path / "s1", "jsonl")
  cmd = [sys.executable, os.path.join(ROOT, "launch", "stage1.py"),
         "--config=" + os.path.join(ROOT, "configs", "stage1_paper.py") + ":qwen3-4b-base,math"]
  cmd += [f"--config.{k}={v}" for k, v in _flat(c).items() if not k.startswith("engine.vllm")]
  path = Stage1Config.from_config(c).dataset_path()
  delay = random.Random(seed).uniform(0.0, 0.05)
  proc = subprocess.Popen(cmd, env=setup["env"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + 600
  while proc.poll() is None and time.time() < deadline:
    if path.exists() and path.read_text().count("\n") >= 2:  # the first batch is written
      break
    time.sleep(0.002)
  time.sleep(delay)
  os.kill(proc.pid, signal.SIGKILL)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL, f"finished before the kill (seed {seed}): {err[-3000:]}"
  written = path.read_text().count("\n")
  print(f"seed {seed}: killed with {written} of {n} prompts written")
  assert 2 <= written < n, f"seed {seed}: {written} of {n} prompts written at the kill"
  out = subprocess.run(cmd, env=setup["env"], cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-4000:]
  _assert_same_stage1(_records(Stage1Config.from_config(c)), _records(ref_cfg), n)


# ------------------------------------------------------------------------------------------------
# Stage 2
# ------------------------------------------------------------------------------------------------


def _anchor_predictions(cfg: Stage2Config):
  anchor = Anchor.load(cfg.anchor_path)
  emb = np.load(os.path.join(cfg.output_dir, "embeddings.npy"))
  return anchor, np.asarray(anchor(emb))


@pytest.fixture(scope="module")
def reference_stage2(setup):
  s1_cfg, _ = _reference_stage1(setup, "jsonl")
  cfg = _stage2_config(setup["ckpts"], s1_cfg.dataset_path(), setup["root"] / "ref_s2")
  _worker("stage2", cfg, "none", setup["server"], expect_kill=False)
  return s1_cfg, _anchor_predictions(cfg)


@pytest.mark.parametrize("point", [
  "mid_fit",
  "mid_anchor_save",
  "after_anchor_save",
])
def test_stage2_killed_then_rerun_gives_the_same_anchor(setup, reference_stage2, tmp_path, point):
  s1_cfg, (want_anchor, want_pred) = reference_stage2
  cfg = _stage2_config(setup["ckpts"], s1_cfg.dataset_path(), tmp_path)
  _worker("stage2", cfg, point, setup["server"], expect_kill=True)
  out = _worker("stage2", cfg, "none", setup["server"], expect_kill=False)
  assert json.loads(out.stdout.split("SUMMARY ", 1)[1])["resumed"] is False  # it fitted again
  anchor, pred = _anchor_predictions(cfg)
  np.testing.assert_array_equal(pred, want_pred)
  assert anchor.meta == want_anchor.meta
  summary = json.loads((tmp_path / "s2" / "stage2_summary.json").read_text())
  assert summary["prompts_fitted"] == N_PROMPTS
