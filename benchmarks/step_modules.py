"""Which modules of `disa_jax/rl/` one Stage 3 step runs (issue 46: "one RL step readable in a few
files").

Builds the on-policy DISA trainer of `tests/rl/test_trainer.py` (tiny model, the JAX sampler in
this process) and traces, with `sys.settrace` and `threading.settrace`, every Python function
called during two `Trainer.step` calls; prints the `disa_jax/rl/` modules they live in, their
count, and the step's metrics (without times), so that two revisions can be compared.

    python benchmarks/step_modules.py
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.rl import test_trainer  # noqa: E402  (the trainer fixture the tests use)

RL = str(ROOT / "disa_jax" / "rl") + os.sep


def traced_modules(steps: int = 2) -> tuple[list[str], dict[str, float]]:
  """(the `disa_jax/rl/` modules run by ``steps`` trainer steps, sorted; the last step's metrics)."""
  seen: set[str] = set()

  def tracer(frame, event, arg):  # pylint: disable=unused-argument
    if event == "call" and frame.f_code.co_filename.startswith(RL):
      seen.add(os.path.relpath(frame.f_code.co_filename, RL))

  with tempfile.TemporaryDirectory() as d:
    trainer, _ = test_trainer._trainer(test_trainer._cfg(steps=steps), d)
    threading.settrace(tracer)
    sys.settrace(tracer)
    try:
      for s in range(steps):
        metrics = trainer.step(s)
    finally:
      sys.settrace(None)
      threading.settrace(None)
      trainer.close()
  return sorted(seen), metrics


def main() -> None:
  modules, metrics = traced_modules()
  print(f"{len(modules)} modules of disa_jax/rl/ run during Trainer.step:")
  for m in modules:
    print(f"  {m}")
  print({k: metrics[k] for k in sorted(metrics) if not k.startswith("time/")
         and k != "tokens_per_s"})


if __name__ == "__main__":
  main()
