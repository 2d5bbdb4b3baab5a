"""Stage 1 (IS labels) and Stage 2 (frozen anchor) end to end on the tabular synthetic problem.

    python -m launch.offline --config=configs/offline_synthetic.py --workdir=/tmp/disa_offline

Writes ``stage1.jsonl`` (resumable), ``anchor/`` (orbax + metadata), ``report.json`` and ``report.md``
to the workdir. A second run with the same workdir skips finished Stage 1 prompts and reloads the anchor.
The job itself is `disa_jax.pipeline.offline_job`.
"""
from __future__ import annotations

from pathlib import Path

from disa_jax import runtime

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from disa_jax.pipeline.offline_job import OfflineConfig, run  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/offline_synthetic.py", "offline config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (created; reused to resume)", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  cfg = OfflineConfig.from_config(_CONFIG.value)
  report = run(cfg, Path(_WORKDIR.value))
  print((Path(_WORKDIR.value) / "report.md").read_text())
  return report


if __name__ == "__main__":
  app.run(main)
