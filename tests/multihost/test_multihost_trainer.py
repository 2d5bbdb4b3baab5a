"""The Stage 3 `Trainer` on two simulated hosts (2 JAX processes x 2 CPU devices, gloo collectives).

Each process leads its own generation process, samples its half of every step's prompts and
all-gathers the completions; the scoring and the updates run on the 4-device cross-process mesh.
The run stops after 2 steps and a fresh pair of processes resumes it for the third. Checks that it
equals one uninterrupted single-process run with an in-process engine (same samples, parameters and
logged metrics), that only process 0 wrote metrics, and that both generation processes hold the
final weights.
"""
from __future__ import annotations

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from disa_jax import models, testing
from disa_jax.rl.build import build_trainer
from disa_jax.rl.metrics import read_jsonl
from disa_jax.rollout.jax_sampler import JaxSampler

sys.path.insert(0, os.path.dirname(__file__))
import mh_trainer_worker as W  # pylint: disable=g-import-not-at-top,wrong-import-position
import mh_worker  # pylint: disable=g-import-not-at-top,wrong-import-position
from test_multihost import NUM_PROCESSES, engine_logprobs_match, run_phase  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.rl import test_trainer as T  # pylint: disable=g-import-not-at-top,wrong-import-position


def _single_process_run(model_path: str, workdir: str):
  policy = models.from_pretrained(model_path)
  engine = JaxSampler.from_pretrained(model_path)
  trainer = build_trainer(W.make_config(3), workdir,
                          T.StepModels(policy, models.from_pretrained(model_path), T._mesh1(),  # pylint: disable=protected-access
                                       pad_to=16),
                          T._task(validation_prompts=T._prompts(3)), T.EngineLink(engine),  # pylint: disable=protected-access
                          T.AnchorInput(T._anchor(policy.config.hidden_size)))  # pylint: disable=protected-access
  trainer.run()
  trainer.close()
  return trainer


@pytest.mark.slow
@pytest.mark.parametrize("staleness", [0, 1])
def test_two_process_trainer_equals_single_process_and_resumes(tmp_path, monkeypatch, staleness):
  # k = 1: each process's rollout thread samples a step ahead; the all-gathers stay in step order.
  monkeypatch.setenv("MH_MAX_STALENESS", str(staleness))
  workdir = str(tmp_path)
  model_path = os.path.join(workdir, "model")
  models.save_pretrained(testing.make_tiny_model(seed=0, **T.TINY), model_path)
  run_phase("2", workdir, timeout_s=240.0, script="mh_trainer_worker.py")
  run_phase("3", workdir, timeout_s=240.0, script="mh_trainer_worker.py")

  ref = _single_process_run(model_path, str(tmp_path / "single"))
  want = mh_worker.flat_params(jax.device_get(nnx.to_pure_dict(ref.parts.updater.state.params)))
  got = dict(np.load(os.path.join(workdir, "params_3.npz")))
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=2e-5, rtol=1e-4, err_msg=k)

  # Process 0 logged steps 1-2 in the first launch and step 3 after resuming; the same samples
  # (rewards, lengths) and the same losses as the single process.
  multi = read_jsonl(os.path.join(workdir, "run", "metrics.jsonl"))
  single = read_jsonl(str(tmp_path / "single" / "metrics.jsonl"))
  assert [r["step"] for r in multi] == [1, 2, 3]
  for m, s in zip(multi, single):
    for key in ("reward", "response_length", "tokens_generated", "eval/mean@2"):
      if key in s:
        assert m[key] == s[key], (m["step"], key)
    for key in ("loss", "grad_norm", "log_z_mean"):
      np.testing.assert_allclose(m[key], s[key], rtol=1e-4, atol=1e-6, err_msg=key)
  assert "eval/mean@2" in multi[1]

  # Both simulated hosts' generation processes hold the final policy; the second launch resumed.
  graphdef, params = nnx.split(models.from_pretrained(model_path), nnx.Param)
  nnx.replace_by_pure_dict(params, jax.device_get(nnx.to_pure_dict(ref.parts.updater.state.params)))
  for pid in range(NUM_PROCESSES):
    npz = np.load(os.path.join(workdir, f"engine_3_{pid}.npz"))
    assert int(npz["start_step"]) == 2
    assert engine_logprobs_match(graphdef, params, npz, prompt=W.PROBE_PROMPT) < 1e-4
