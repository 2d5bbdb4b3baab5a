r"""LoRA-SFT baseline entry point (App. C.4): Stage 1 reward-1 trajectories -> merged HF model.

  python launch/sft.py --config=configs/sft_paper.py:qwen2.5-7b \
      --config.reference_path=/models/Qwen2.5-7B --config.stage1_path=/runs/stage1/q25-math \
      --config.out_path=/runs/sft/q25-math

Multi-host: start the same command on every host (SLURM: ``launch/slurm/sft.sbatch``; TPU pods:
``launch/tpu_pod.sh``); `disa_jax.parallel.distributed.initialize` reads the launcher's environment
and the mesh spans every process. Re-running resumes from the adapter checkpoints under
``<out_path>.ckpt`` and does nothing once the export exists.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/sft_paper.py:BACKBONE")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate and print the config, then exit.")


def main(argv):
  del argv
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  spec = distributed.initialize()
  from disa_jax import parallel  # pylint: disable=g-import-not-at-top
  from disa_jax.sft.baseline import LoRASFTConfig, run_lora_sft  # pylint: disable=g-import-not-at-top
  c = _CONFIG.value
  sft_cfg = LoRASFTConfig.from_dict(c.sft.to_dict())
  for field in ("reference_path", "stage1_path", "out_path"):
    if not c[field]:
      raise app.UsageError(f"--config.{field} is required, got {c[field]!r}")
  main_process = distributed.is_main_process()
  if _DRY_RUN.value:
    if main_process:
      print(json.dumps({"launch": spec.source, **c.to_dict(), "sft": sft_cfg.to_dict()}, indent=2))
    return
  mesh = parallel.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
  summary = run_lora_sft(c.reference_path, c.stage1_path, c.out_path, sft_cfg, mesh=mesh,
                         log=print if main_process else None)
  if main_process:
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
  app.run(main)
