r"""Evaluation entry point: a checkpoint x a benchmark suite -> markdown and JSON tables.

  python launch/evaluate.py --config=configs/eval_paper.py:math \
      --config.run_dir=/runs/disa-q3-4b-math --config.output_dir=/runs/eval/disa-q3-4b-math

``--config.run_dir`` exports the run's best policy checkpoint by validation (``run_checkpoint``:
'best' | 'latest' | a step) to an HF directory first; give
``--config.model_path=DIR`` instead to evaluate any local HF model.

Paper protocol: temperature 0.6, top-p 0.95, Mean@8 (math) and pass@1 / pass@16 (code). Writes
``<name>.md`` / ``<name>.json`` per benchmark and ``summary.md`` / ``summary.json``; a rerun skips
finished benchmarks. See `disa_jax.workflows.evaluation`.
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from disa_jax import launcher  # noqa: E402
from disa_jax.workflows.evaluation import EvalConfig, run_evaluation  # noqa: E402

_CONFIG = launcher.define_flags("Evaluation config (configs/eval_paper.py:...).")

if __name__ == "__main__":
  launcher.run(_CONFIG, EvalConfig.from_config, lambda cfg: run_evaluation(cfg).to_json())
