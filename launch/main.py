"""The main job: the whole DISA pipeline on the sum task with an exact partition function.

    python -m launch.main --workdir=/tmp/disa_main [--config=configs/main.py] [--config.engine=vllm]

Prints report.md at the end; the workdir holds report.json, plots, models, Stage 1 data, the anchor,
Stage 3 runs and evaluations. Rerunning with the same workdir resumes.
"""
from pathlib import Path

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main.py", "main-job config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (created; reused to resume)", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from disa_jax.pipeline.sum_job import MainConfig, SumJob
  cfg = MainConfig.from_config(_CONFIG.value)  # validates once: a bad value stops here, naming the field
  SumJob(cfg, _WORKDIR.value).run()
  print((Path(_WORKDIR.value) / "report.md").read_text())


if __name__ == "__main__":
  app.run(main)
