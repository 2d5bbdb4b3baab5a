"""Two JAX processes on this machine through `jax.distributed` (gloo CPU collectives).

Each process is a simulated host with 2 CPU devices; together they form one 4-device mesh. Checks:
- one DISA update on the cross-process mesh, each process feeding only its own rows, equals the
  same update in one process without a mesh;
- the orbax checkpoint written by both processes resumes in a fresh pair of processes, and the
  resumed update equals the second single-process update;
- each process's own generation process receives the updated weights (its raw log-probs equal the
  reference model's after the update, and differ from the initial model's).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from disa_jax import models, testing
from disa_jax.rl import update as rl_update
from disa_jax.scoring import token_logprobs
from disa_jax.testing import save_tiny_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
import mh_worker  # pylint: disable=g-import-not-at-top,wrong-import-position

NUM_PROCESSES = 2
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_phase(phase: str, workdir: str, timeout_s: float = 150.0,
              script: str = "mh_worker.py") -> None:
  """Starts NUM_PROCESSES ``script PHASE WORKDIR`` workers; kills all of them if one fails or the
  deadline passes."""
  port = testing.free_port()
  procs, logs = [], []
  env_base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  for pid in range(NUM_PROCESSES):
    env = dict(env_base, DISA_COORDINATOR=f"localhost:{port}",
               DISA_NUM_PROCESSES=str(NUM_PROCESSES), DISA_PROCESS_ID=str(pid))
    log = open(os.path.join(workdir, f"log_{phase}_{pid}.txt"), "w")
    logs.append(log)
    procs.append(subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), script), phase, workdir],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
  try:
    for p in procs:
      p.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    pass
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  codes = [p.returncode for p in procs]
  if any(codes):
    tails = []
    for pid in range(NUM_PROCESSES):
      with open(os.path.join(workdir, f"log_{phase}_{pid}.txt")) as f:
        tails.append(f"--- process {pid} (rc {codes[pid]}) ---\n" + f.read()[-3000:])
    pytest.fail(f"phase {phase} failed:\n" + "\n".join(tails))


def _reference_updates(model_path: str):
  """Two single-process DISA updates (no mesh); returns the params after each and the metrics."""
  model = models.from_pretrained(model_path)
  opt = mh_worker.make_optimizer()
  graphdef, _, state, _ = rl_update.init_train_state(model, opt)
  update = rl_update.make_train_step(graphdef=graphdef, objective=mh_worker.objective(),
                                     optimizer=opt, options=rl_update.StepOptions(donate=False))
  out = []
  for step in range(2):
    micro = mh_worker.make_batch(step, model.config.vocab_size)
    assert len(micro) == 2
    state, metrics = update(state, micro)
    out.append((mh_worker.flat_params(jax.device_get(nnx.to_pure_dict(state.params))),
                jax.device_get(metrics), graphdef, state.params))
  return out


def engine_logprobs_match(graphdef, params, npz, prompt=mh_worker.PROMPT) -> float:
  """Max |engine raw log-prob - reference token log-prob| over the sampled tokens."""
  model = nnx.merge(graphdef, params)
  prompt = list(prompt)
  toks = [int(t) for t in npz["token_ids"]]
  ids = jnp.asarray([prompt + toks], jnp.int32)
  lp = np.asarray(token_logprobs(model, ids, jnp.ones_like(ids)))[0, len(prompt):]
  return float(np.max(np.abs(lp - npz["raw_logprobs"])))


@pytest.mark.slow
def test_two_process_train_checkpoint_and_weight_push(tmp_path):
  workdir = str(tmp_path)
  model_path = save_tiny_checkpoint(os.path.join(workdir, "model"))
  run_phase("a", workdir)
  run_phase("b", workdir)
  ref = _reference_updates(model_path)
  init = models.from_pretrained(model_path)
  init_graphdef, init_params = nnx.split(init, nnx.Param)

  for i, phase in enumerate("ab"):
    got = dict(np.load(os.path.join(workdir, f"params_{phase}.npz")))
    want, want_metrics, graphdef, params = ref[i]
    assert sorted(got) == sorted(want)
    for k in want:
      np.testing.assert_allclose(got[k], want[k], atol=2e-5, rtol=1e-4, err_msg=f"{phase}:{k}")
    with open(os.path.join(workdir, f"metrics_{phase}.json")) as f:
      metrics = json.load(f)
    for k in ("loss", "grad_norm", "num_sequences"):
      np.testing.assert_allclose(metrics[k], float(want_metrics[k]), rtol=1e-4, err_msg=k)
    # Each simulated host's generation process holds the updated weights.
    for pid in range(NUM_PROCESSES):
      npz = np.load(os.path.join(workdir, f"engine_{phase}_{pid}.npz"))
      assert list(npz["rows"]) == [2 * pid, 2 * pid + 2]  # each process fed its own rows
      assert engine_logprobs_match(graphdef, params, npz) < 1e-4
      assert engine_logprobs_match(init_graphdef, init_params, npz) > 1e-3
  # Only process 0 wrote the parameters and metrics.
  written = sorted(f for f in os.listdir(workdir) if f.startswith(("params_", "metrics_")))
  assert written == ["metrics_a.json", "metrics_b.json", "params_a.npz", "params_b.npz"]
