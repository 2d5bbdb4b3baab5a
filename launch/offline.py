"""Stage 1 (IS labels) and Stage 2 (frozen anchor) end to end on the tabular synthetic problem.

    python -m launch.offline --config=configs/offline_synthetic.py --workdir=/tmp/disa_offline

Writes ``stage1.jsonl`` (resumable), ``anchor/`` (orbax + metadata), ``report.json`` and ``report.md``
to the workdir. A second run with the same workdir skips finished Stage 1 prompts and reloads the anchor.
The job itself is `disa_jax.pipeline.offline_job`.
"""
import os
import sys
from pathlib import Path

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from disa_jax import launcher  # noqa: E402
from absl import flags, logging  # noqa: E402

from disa_jax.pipeline.offline_job import OfflineConfig, run  # noqa: E402
from disa_jax.workflows.preflight import require_writable  # noqa: E402

_CONFIG = launcher.define_flags("offline config file", default_config="configs/offline_synthetic.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (created; reused to resume)", required=True)


def convert(config):
  cfg = OfflineConfig.from_config(config)
  require_writable({"--workdir": _WORKDIR.value})
  return cfg


def execute(cfg):
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  run(cfg, Path(_WORKDIR.value))
  print((Path(_WORKDIR.value) / "report.md").read_text())


if __name__ == "__main__":
  launcher.run(_CONFIG, convert, execute, check=None)  # a tabular problem, no models
