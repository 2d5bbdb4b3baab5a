"""One process of the simulated two-host Stage 3 run used by `test_multihost_trainer.py`.

Run as ``python mh_trainer_worker.py STEPS WORKDIR`` with ``DISA_COORDINATOR``,
``DISA_NUM_PROCESSES`` and ``DISA_PROCESS_ID`` set. Each process drives 2 CPU devices and one
generation process (a `RemoteEngine` 'jax' engine: every process leads its simulated host). The
`Trainer` runs (or resumes) to STEPS RL steps in ``WORKDIR/run``; afterwards process 0 writes the
parameters and every process samples greedily from its own generation process.
"""
from __future__ import annotations

import os
import sys

import mh_worker  # this script's directory is on sys.path; mh_worker imports no JAX

PROBE_PROMPT = [5, 9, 11, 7]


def make_config(steps: int):
  """The run's config, shared with the single-process reference in the test."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  from disa_jax.rl import config as rl_config  # pylint: disable=g-import-not-at-top
  from tests.rl import test_trainer as T  # pylint: disable=g-import-not-at-top
  cfg = T._cfg(method="disa", steps=steps)  # pylint: disable=protected-access
  staleness = int(os.environ.get("MH_MAX_STALENESS", "0"))  # asynchronous rollouts (the test's k)
  return dataclasses.replace(
      cfg, rollout=dataclasses.replace(cfg.rollout, prompts_per_batch=4, micro_batch_rows=4,
                                       max_staleness=staleness),
      validation=rl_config.ValidationConfig(every=2, n=2, max_tokens=6),
      checkpoint=rl_config.CheckpointConfig(every=1, keep=3, async_save=False), tensorboard=False)


def main(steps: int, workdir: str) -> None:
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  distributed.initialize()
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  from disa_jax import models, rollout  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import make_mesh  # pylint: disable=g-import-not-at-top
  from disa_jax.rl.build import build_trainer  # pylint: disable=g-import-not-at-top
  from tests.rl import test_trainer as T  # pylint: disable=g-import-not-at-top

  assert jax.process_count() == 2 and len(jax.devices()) == 2 * mh_worker.DEVICES_PER_PROCESS
  model_path = os.path.join(workdir, "model")
  engine = rollout.make_engine("jax", model_path, process=rollout.ProcessOptions(
      timeout_s=120.0, startup_timeout_s=120.0))
  try:
    mesh = make_mesh(fsdp=-1)  # the 4 devices of both processes
    policy = models.from_pretrained(model_path, mesh=mesh)
    reference = models.from_pretrained(model_path, mesh=mesh)
    trainer = build_trainer(make_config(steps), os.path.join(workdir, "run"),
                            T.StepModels(policy, reference, mesh, pad_to=16),
                            T._task(validation_prompts=T._prompts(3)), T.EngineLink(engine),  # pylint: disable=protected-access
                            T.AnchorInput(T._anchor(policy.config.hidden_size)))  # pylint: disable=protected-access
    trainer.run()
    trainer.close()
    params = distributed.replicate_to_hosts(nnx.to_pure_dict(trainer.parts.updater.state.params))
    if distributed.is_main_process():
      np.savez(os.path.join(workdir, f"params_{steps}.npz"), **mh_worker.flat_params(params))
    comp = engine.generate([PROBE_PROMPT], rollout.SamplingParams(
        n=1, temperature=0.0, max_tokens=6, return_raw_logprobs=True))[0][0]
    np.savez(os.path.join(workdir, f"engine_{steps}_{jax.process_index()}.npz"),
             token_ids=comp.token_ids, raw_logprobs=comp.raw_logprobs,
             start_step=np.array(trainer.start_step))
    distributed.sync_global(f"done_{steps}")
  finally:
    engine.close()


if __name__ == "__main__":
  mh_worker.prepare_process()
  main(int(sys.argv[1]), sys.argv[2])
