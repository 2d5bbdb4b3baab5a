r"""LoRA-SFT baseline entry point (App. D.4): Stage 1 reward-1 trajectories -> merged HF model.

  python launch/sft.py --config=configs/sft_paper.py:qwen2.5-7b \
      --config.reference_path=/models/Qwen2.5-7B --config.stage1_path=/runs/stage1/q25-math/stage1 \
      --config.out_path=/runs/sft/q25-math

A thin flag parser around `disa_jax.workflows.sft.run_sft`. Multi-host: start the same command on
every host (SLURM: ``launch/slurm/``; TPU pods: ``launch/tpu_pod.sh``);
`disa_jax.parallel.distributed.initialize` reads the launcher's environment and the mesh spans
every process. Re-running resumes from the adapter checkpoints under ``<out_path>.ckpt`` and does
nothing once the export exists. ``--dry_run`` checks the config, mesh and paths without loading weights.
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from disa_jax import launcher  # noqa: E402
from disa_jax.parallel import distributed  # noqa: E402
from disa_jax.workflows.sft import SftConfig, run_sft  # noqa: E402

_CONFIG = launcher.define_flags("configs/sft_paper.py:BACKBONE")


def convert(config):
  distributed.initialize()  # no-op without a multi-process launcher's variables
  return SftConfig.from_config(config)


def execute(cfg):
  main_process = distributed.is_main_process()
  run = run_sft(cfg, log=print if main_process else None)
  return run.to_json() if main_process else None


if __name__ == "__main__":
  launcher.run(_CONFIG, convert, execute)
