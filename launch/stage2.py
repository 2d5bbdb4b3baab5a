r"""Stage 2 entry point: reference prompt embeddings -> anchor fit -> the frozen anchor for Stage 3.

  python launch/stage2.py --config=configs/stage2_paper.py:qwen3-4b-base,math \
      --config.stage1_path=/runs/stage1/stage1 --config.reference_path=/models/Qwen3-4B-Base \
      --config.anchor_path=/anchors/q3-4b-math --config.output_dir=/runs/stage2

Writes the validation curve (PNG) and summary JSON to output_dir and the anchor to anchor_path (the
directory Stage 3's ``--config.data.anchor_path`` names). A rerun finds the anchor and stops. See
`disa_jax.workflows.stage2`.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from disa_jax.workflows.stage2 import Stage2Config, run_stage2  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None,
                                          "Stage 2 config (configs/stage2_paper.py:...).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate and print the config, then exit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  cfg = Stage2Config.from_config(_CONFIG.value)
  if _DRY_RUN.value:
    from disa_jax import config as config_lib  # pylint: disable=g-import-not-at-top
    print(json.dumps(config_lib.to_dict(cfg), indent=1))
    return
  summary = run_stage2(cfg)
  summary.pop("history", None)  # long; it is in stage2_summary.json
  print(json.dumps(summary, indent=1))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
