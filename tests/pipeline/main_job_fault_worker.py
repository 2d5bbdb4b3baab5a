"""`launch/main.py` with a fault injected (issue 65): runs the command's own code (`runpy`, the
flags after POINT) after arming POINT:

- 'kill_mid_model_save': SIGKILL once half of the first model's weights file is written.
- 'kill_mid_prompts_save': SIGKILL once half of the prompt file is written.
- 'stop_after_models': exit 0 once the models and the prompt file are in place.

Usage: main_job_fault_worker.py POINT --workdir=... --config=...
"""
import os
import runpy
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _half_then_die(path: Path) -> None:
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
  from disa_jax.pipeline import sum_job, sum_models  # pylint: disable=g-import-not-at-top
  if point == "kill_mid_model_save":
    real = sum_models.save_pretrained

    def save_pretrained(model, path, **kwargs):
      real(model, path, **kwargs)
      _half_then_die(Path(path) / "model.safetensors")

    sum_models.save_pretrained = save_pretrained
  elif point == "kill_mid_prompts_save":
    real_prompts = sum_job.save_prompts

    def save_prompts(records, path):
      real_prompts(records, path)
      _half_then_die(Path(path))

    sum_job.save_prompts = save_prompts
  elif point == "stop_after_models":
    build = sum_job.SumJob.build_models

    def build_models(self):
      build(self)
      os._exit(0)  # pylint: disable=protected-access

    sum_job.SumJob.build_models = build_models
  else:
    raise SystemExit(f"unknown point {point!r}")


if __name__ == "__main__":
  sys.path.insert(0, str(ROOT))
  point, flags = sys.argv[1], sys.argv[2:]
  arm(point)
  sys.argv = [str(ROOT / "launch" / "main.py"), *flags]
  runpy.run_path(sys.argv[0], run_name="__main__")
