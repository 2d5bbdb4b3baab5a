r"""LoRA-SFT baseline entry point (App. D.4): Stage 1 reward-1 trajectories -> merged HF model.

  python launch/sft.py --config=configs/sft_paper.py:qwen2.5-7b \
      --config.reference_path=/models/Qwen2.5-7B --config.stage1_path=/runs/stage1/q25-math/stage1 \
      --config.out_path=/runs/sft/q25-math

A thin flag parser around `disa_jax.workflows.sft.run_sft`. Multi-host: start the same command on
every host (SLURM: ``launch/slurm/``; TPU pods: ``launch/tpu_pod.sh``);
`disa_jax.parallel.distributed.initialize` reads the launcher's environment and the mesh spans
every process. Re-running resumes from the adapter checkpoints under ``<out_path>.ckpt`` and does
nothing once the export exists. ``--dry_run`` prints the validated config and exits.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/sft_paper.py:BACKBONE")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate and print the config, then exit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from disa_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  from disa_jax.workflows.sft import SftConfig, run_sft  # pylint: disable=g-import-not-at-top
  cfg = SftConfig.from_config(_CONFIG.value)
  if _DRY_RUN.value:
    print(json.dumps(config_lib.to_dict(cfg), indent=1))
    return
  distributed.initialize()  # no-op without a multi-process launcher's variables
  main_process = distributed.is_main_process()
  summary = run_sft(cfg, log=print if main_process else None)
  if main_process:
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
