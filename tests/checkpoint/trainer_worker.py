"""Runs the tiny DISA `Trainer` of tests/rl/test_trainer.py in a subprocess (killed with -9).

Usage: trainer_worker.py WORKDIR TOTAL_STEPS. Checkpoints every step (async); resumes from the
latest checkpoint in WORKDIR automatically.
"""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.rl import test_trainer as tt  # noqa: E402


def main():
  workdir, steps = sys.argv[1], int(sys.argv[2])
  cfg = tt._cfg(steps=steps)  # pylint: disable=protected-access
  trainer, _ = tt._trainer(cfg, workdir)  # pylint: disable=protected-access
  trainer.run()
  trainer.close()


if __name__ == "__main__":
  main()
