"""One process of the simulated multi-host run used by `test_multihost.py`.

Run as ``python mh_worker.py PHASE WORKDIR`` with ``DISA_COORDINATOR``, ``DISA_NUM_PROCESSES`` and
``DISA_PROCESS_ID`` set. Each process drives 2 CPU devices (a "host"); the global mesh spans all
processes. Phase ``a`` starts from the checkpoint in ``WORKDIR/model`` and does one DISA update;
phase ``b`` resumes from the orbax checkpoint written by phase ``a`` and does the next one. After the
update every process pushes the gathered weights into its own generation process (a `RemoteEngine`
'jax' engine) and samples from it; process 0 alone writes the updated parameters.

The batch maker and optimizer settings are shared with the single-process reference in the test.
"""
from __future__ import annotations

import json
import os
import sys

DEVICES_PER_PROCESS = 2
LEARNING_RATE = 1e-2
MICRO_BATCH = 4  # packed rows per micro-batch; 2 micro-batches per update
ROWS, WIDTH, PROMPT_LEN = 8, 16, 6
PROMPT = [5, 9, 11, 7]
MAX_TOKENS = 6


def prepare_process() -> None:
  """Run before JAX is imported in a worker: CPU only, DEVICES_PER_PROCESS devices, repo importable."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
  sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def make_batch(step: int, vocab: int):
  """The global mini-batch of update ``step`` (identical on every process): numpy `TrainBatch`
  micro-batches of MICRO_BATCH packed rows of WIDTH tokens."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from disa_jax.data.packing import PackingLayout  # pylint: disable=g-import-not-at-top
  from tests.rl.helpers import scored_sequences  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1000 + step)
  resp_len = rng.integers(1, WIDTH - PROMPT_LEN + 1, ROWS)
  width = WIDTH - PROMPT_LEN
  mask = np.arange(width)[None] < resp_len[:, None]
  logp = lambda: (-rng.uniform(3.5, 5.5, (ROWS, width)) * mask).astype(np.float32)
  prompts = [rng.integers(3, vocab, PROMPT_LEN) for _ in range(ROWS)]
  responses = [rng.integers(3, vocab, n) for n in resp_len]
  old_logp, ref_logp = logp(), logp()
  seqs = scored_sequences(prompts, responses, old_logp, ref_logp,
                          signal=rng.integers(0, 2, ROWS).astype(np.float32),
                          log_z=rng.normal(-4.0, 1.0, ROWS).astype(np.float32))
  return seqs.micro_batches(np.arange(ROWS), PackingLayout(row_len=WIDTH, rows=MICRO_BATCH),
                            pad_id=0)


def objective():
  """The update's objective: DISA, omega = 1."""
  from disa_jax.rl.objectives import Disa  # pylint: disable=g-import-not-at-top
  return Disa(beta=15.0, scale="mean")


def make_optimizer():
  from disa_jax.rl import update as rl_update  # pylint: disable=g-import-not-at-top
  # eps=1e-3: elements whose gradient is at float noise (|g| << eps) move by lr*g/eps, not by
  # lr*sign(g); otherwise a cross-process reduction order flips such an element by a whole step.
  return rl_update.make_optimizer(LEARNING_RATE, weight_decay=0.0, grad_clip=0.0, eps=1e-3)


def flat_params(pure: dict, prefix: str = "") -> dict:
  """Nested pure dict -> {'a/b/c': array}."""
  out = {}
  for k, v in pure.items():
    name = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(flat_params(v, name + "/"))
    else:
      out[name] = v
  return out


def main(phase: str, workdir: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  spec = distributed.initialize()
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

  from disa_jax import models, rollout  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout import multihost  # pylint: disable=g-import-not-at-top
  from disa_jax.checkpoint import CheckpointManager  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import make_mesh  # pylint: disable=g-import-not-at-top
  from disa_jax.rl import update as rl_update  # pylint: disable=g-import-not-at-top

  pid = jax.process_index()
  assert spec.source == "env" and jax.process_count() == spec.num_processes, spec
  assert len(jax.local_devices()) == DEVICES_PER_PROCESS and len(jax.devices()) == (
      DEVICES_PER_PROCESS * jax.process_count())
  model_path = os.path.join(workdir, "model")
  # One generation process per (simulated) host, started from the initial weights.
  engine = rollout.make_engine("jax", model_path, process=rollout.ProcessOptions(
      timeout_s=120.0, startup_timeout_s=120.0))
  try:
    mesh = make_mesh(fsdp=-1)  # all devices of all processes
    model = models.from_pretrained(model_path, mesh=mesh)
    opt = make_optimizer()
    graphdef, _, state, shardings = rl_update.init_train_state(model, opt, mesh=mesh)
    update = rl_update.make_train_step(
        graphdef=graphdef, objective=objective(), optimizer=opt, mesh=mesh,
        state_shardings=shardings, options=rl_update.StepOptions(donate=False))
    ckpt = CheckpointManager(os.path.join(workdir, "ckpt"), async_save=False)

    def ckpt_state(s):
      return {"step": s.step, "params": nnx.to_pure_dict(s.params), "opt_state": s.opt_state}

    if phase == "b":
      restored_step, restored, meta = ckpt.restore(ckpt_state(state))
      assert meta["process_count"] == jax.process_count(), meta
      params = state.params
      nnx.replace_by_pure_dict(params, restored["params"])
      state = rl_update.TrainState(restored["step"], params, restored["opt_state"], None, None)
      assert int(restored_step) == 1
    step = int(jax.device_get(state.step))
    micro = make_batch(step, model.config.vocab_size)
    sharding = NamedSharding(mesh, PartitionSpec(rl_update.BATCH_AXES))
    rows = distributed.process_rows(sharding, micro[0].rows.input_ids.shape, axis=0)
    state, metrics = update(state, rl_update.place_micro_batches(micro, mesh))
    ckpt.save(step + 1, ckpt_state(state), {"process_count": jax.process_count()}, force=True)
    ckpt.close()

    nnx.update(model, state.params)
    multihost.push_weights(model, engine)
    comp = engine.generate([PROMPT], rollout.SamplingParams(
        n=1, temperature=1.0, max_tokens=MAX_TOKENS, seed=7, return_raw_logprobs=True))[0][0]
    np.savez(os.path.join(workdir, f"engine_{phase}_{pid}.npz"), token_ids=comp.token_ids,
             raw_logprobs=comp.raw_logprobs, rows=np.array([rows.start, rows.stop]))

    params = distributed.replicate_to_hosts(nnx.to_pure_dict(state.params))
    metrics = distributed.replicate_to_hosts(metrics)
    if distributed.is_main_process():
      np.savez(os.path.join(workdir, f"params_{phase}.npz"), **flat_params(params))
      with open(os.path.join(workdir, f"metrics_{phase}.json"), "w") as f:
        json.dump({k: float(v) for k, v in metrics.items()}, f)
    distributed.sync_global(f"done_{phase}")
  finally:
    engine.close()


if __name__ == "__main__":
  prepare_process()
  main(sys.argv[1], sys.argv[2])
