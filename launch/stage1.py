r"""Stage 1 entry point: proposal samples, rewards and log pi_ref -> the resumable IS-label dataset.

  python launch/stage1.py --config=configs/stage1_paper.py:qwen3-4b-base,math \
      --config.reference_path=/models/Qwen3-4B-Base \
      --config.proposal_path=/models/Qwen3-235B-A22B-Instruct-2507 \
      --config.prompts_path=/data/dapo-17k-processed.parquet --config.output_dir=/runs/stage1

Rerunning with the same output_dir resumes (finished prompts are skipped). Prints the summary
(ESS / CV^2 quantiles, share of prompts without a reward-bearing sample, throughput) that is also
written to ``<output_dir>/stage1_summary.json``. See `disa_jax.workflows.stage1`.
"""
from __future__ import annotations

import os
import sys

# The JAX reference scorer shares the GPUs with the proposal's vLLM engine (started after it): JAX
# must not pre-allocate most of every GPU's memory first.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from disa_jax import launcher  # noqa: E402
from disa_jax.workflows.stage1 import Stage1Config, run_stage1  # noqa: E402

_CONFIG = launcher.define_flags("Stage 1 config (configs/stage1_paper.py:...).")

if __name__ == "__main__":
  launcher.run(_CONFIG, Stage1Config.from_config, lambda cfg: run_stage1(cfg).to_json())
