"""The LoRA-SFT baseline on two simulated hosts equals the single-process run.

Two JAX processes x 2 CPU devices (gloo) run `run_lora_sft` on one 4-device mesh, each feeding only
its own rows of every micro-batch and checkpointing through orbax's multi-process path; process 0
writes the merged export. Its logits must equal those of the same run in one process.
"""
from __future__ import annotations

import json
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax import models
from disa_jax.sft import baseline
from disa_jax.testing import save_tiny_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import mh_sft_worker as W  # pylint: disable=g-import-not-at-top,wrong-import-position
from test_multihost import run_phase  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.sft.test_baseline import _write_stage1  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.slow
def test_two_process_lora_sft_equals_single_process(tmp_path):
  workdir = str(tmp_path)
  ref = save_tiny_checkpoint(os.path.join(workdir, "ref"), "qwen2")
  s1 = _write_stage1(os.path.join(workdir, "s1.jsonl"))
  run_phase("sft", workdir, timeout_s=240.0, script="mh_sft_worker.py")
  single = baseline.run_lora_sft(ref, s1, str(tmp_path / "single"), W.make_config())
  with open(os.path.join(workdir, "sft", baseline.SUMMARY_FILE)) as f:
    multi = json.load(f)
  assert multi["steps"] == single["steps"] == 4 and multi["num_kept"] == single["num_kept"] == 5
  np.testing.assert_allclose(multi["loss_last"], single["loss_last"], rtol=1e-4)
  ids = jnp.asarray([[5, 9, 11, 7, 12, 13, 14, 15]], jnp.int32)
  got = np.asarray(models.from_pretrained(os.path.join(workdir, "sft"))(ids))
  want = np.asarray(models.from_pretrained(str(tmp_path / "single"))(ids))
  base = np.asarray(models.from_pretrained(ref)(ids))
  assert np.abs(want - base).max() > 1e-4  # the run trained
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
  assert sorted(os.listdir(os.path.join(workdir, "sft.ckpt"))) == ["4"]  # orbax kept the last step
