"""The main job: the whole DISA pipeline on the sum task with an exact partition function.

    python -m launch.main --workdir=/tmp/disa_main [--config=configs/main.py] [--config.engine.kind=vllm]

A thin flag parser around `disa_jax.pipeline.sum_job.SumJob`, which builds the task's tiny models and
prompts and runs the real Stage 1 / 2 / 3 / SFT / evaluation workflows. Prints report.md at the
end; the workdir holds report.json, plots, models, Stage 1 data, the anchor, Stage 3 runs and
evaluations. Rerunning with the same workdir resumes.
"""
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import flags, logging  # noqa: E402

from disa_jax import launcher  # noqa: E402
from disa_jax.pipeline.job_config import MainConfig  # noqa: E402
from disa_jax.pipeline.sum_job import SumJob  # noqa: E402
from disa_jax.workflows.preflight import require_writable  # noqa: E402

_CONFIG = launcher.define_flags("main-job config file", default_config="configs/main.py")
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (created; reused to resume)", required=True)


def convert(config):
  # Every stage's config is converted and validated here: a bad value stops at once, naming it.
  cfg = MainConfig.from_config(config)
  require_writable({"--workdir": _WORKDIR.value})
  return cfg


def execute(cfg):
  logging.set_verbosity(logging.WARNING)
  report = SumJob(cfg, _WORKDIR.value).run()
  print(report.markdown())


if __name__ == "__main__":
  launcher.run(_CONFIG, convert, execute, check=None)  # builds its own tiny models and data
