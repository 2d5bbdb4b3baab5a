r"""The paper's offline-budget study (App. C.3): stratified subset -> Stage 1 pool of 32 -> log Z_M
statistics for M = 2, 4, 8, 16.

  python launch/nstudy.py --config=configs/nstudy_paper.py:qwen3-4b-base,math \
      --config.stage1.reference_path=/models/Qwen3-4B-Base \
      --config.stage1.proposal_path=/models/Qwen3-235B-A22B-Instruct-2507 \
      --config.stage1.prompts_path=/data/dapo-17k-processed.parquet --config.output_dir=/runs/nstudy

Rerunning with the same output_dir resumes (the subset is reused, Stage 1 skips finished prompts).
Prints the statistics also written to ``<output_dir>/nstudy.json`` (figure: ``nstudy.png``); see
`disa_jax.workflows.nstudy`. `--dry_run` checks the pool's Stage 1 config as `launch/stage1.py` does.
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
from disa_jax.workflows.nstudy import NStudyConfig, preflight_nstudy, run_nstudy  # noqa: E402

_CONFIG = launcher.define_flags("N-study config (configs/nstudy_paper.py:...).")

if __name__ == "__main__":
  launcher.run(_CONFIG, NStudyConfig.from_config, lambda cfg: run_nstudy(cfg).to_json(),
               check=preflight_nstudy)
