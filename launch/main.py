"""The main job: the whole DISA pipeline on the sum task with an exact partition function.

    python -m launch.main --workdir=/tmp/disa_main [--config=configs/main.py] [--config.engine.kind=vllm]

A thin flag parser around `disa_jax.pipeline.sum_job.SumJob`, which builds the task's tiny models and
prompts and runs the real Stage 1 / 2 / 3 / SFT / evaluation workflows. Prints report.md at the
end; the workdir holds report.json, plots, models, Stage 1 data, the anchor, Stage 3 runs and
evaluations. Rerunning with the same workdir resumes.
"""
from pathlib import Path

from disa_jax import runtime

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/main.py", "main-job config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (created; reused to resume)", required=True)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from disa_jax.pipeline.sum_job import MainConfig, SumJob
  # Every stage's config is converted and validated here: a bad value stops at once, naming it.
  job = SumJob(MainConfig.from_config(_CONFIG.value), _WORKDIR.value)
  job.run()
  print((Path(_WORKDIR.value) / "report.md").read_text())


if __name__ == "__main__":
  app.run(main)
