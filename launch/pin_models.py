"""Pins a main-job preset's tiny models: trains pi_ref and p_T on this machine (or takes those a
workdir already holds) and writes their entry of disa_jax/pipeline/pinned_models/ (`pipeline.pinned`).

    python -m launch.pin_models --workdir=/tmp/pin_default --config=configs/main.py
    python -m launch.pin_models --workdir=/tmp/pin_testbed --config=configs/main.py:anchor_testbed

Presets with the same architecture, task range and warm-up specs share one entry. Commit the entry
(its pin.json names each file's sha256 and size); every job then copies it instead of training.
"""
import dataclasses
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import flags  # noqa: E402

from disa_jax import codec, launcher  # noqa: E402
from disa_jax.pipeline import pinned  # noqa: E402
from disa_jax.pipeline.job_config import MainConfig  # noqa: E402
from disa_jax.pipeline.sum_job import SumJob  # noqa: E402

_CONFIG = launcher.define_flags("main-job config file", default_config="configs/main.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "where the models are trained (reused)",
                               required=True)


def execute(cfg: MainConfig):
  job = SumJob(dataclasses.replace(cfg, rebuild_models=True), _WORKDIR.value)
  job.build_models()
  out = pinned.pin(job.dir / "models", pinned.identity(cfg))
  record = codec.load(pinned.PinRecord, out / pinned.PinRecord.FILE, "pinned models")
  return {"pin": str(out), "bytes": record.bytes, "fingerprint": record.fingerprint}


if __name__ == "__main__":
  launcher.run(_CONFIG, MainConfig.from_config, execute, check=None)
