r"""Stage 2 entry point: reference prompt embeddings -> anchor fit -> the frozen anchor for Stage 3.

  python launch/stage2.py --config=configs/stage2_paper.py:qwen3-4b-base,math \
      --config.stage1_path=/runs/stage1/stage1 --config.reference_path=/models/Qwen3-4B-Base \
      --config.anchor_path=/anchors/q3-4b-math --config.output_dir=/runs/stage2

Writes the validation curve (PNG) and summary JSON to output_dir and the anchor to anchor_path (the
directory Stage 3's ``--config.data.anchor_path`` names). A rerun finds the anchor and stops. See
`disa_jax.workflows.stage2`.
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
from disa_jax.workflows.stage2 import Stage2Config, run_stage2  # noqa: E402

_CONFIG = launcher.define_flags("Stage 2 config (configs/stage2_paper.py:...).")


def execute(cfg):
  summary = run_stage2(cfg).to_json()
  summary.pop("history", None)  # long; it is in stage2_summary.json
  return summary


if __name__ == "__main__":
  launcher.run(_CONFIG, Stage2Config.from_config, execute)
