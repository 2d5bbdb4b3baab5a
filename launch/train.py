r"""Stage 3 entry point: DISA / FlowRL / GRPO / GSPO training.

  python launch/train.py --config=configs/stage3_paper.py:disa,qwen2.5-7b,math \
      --config.model.policy_path=/models/Qwen2.5-7B --config.data.anchor_path=/anchors/q25-math \
      --workdir=/runs/disa-q25-math

A thin flag parser around `disa_jax.workflows.stage3.run_stage3`: the ConfigDict (with
``--config.field=value`` overrides) is converted once into the typed `Stage3Config`, which validates
every field. Re-running with the same ``--workdir`` resumes from its latest checkpoint.
``--dry_run`` prints the validated config and exits.
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

_CONFIG = config_flags.DEFINE_config_file("config", None,
                                          "Stage 3 config file (configs/stage3_paper.py:...).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (sets config.workdir).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Validate and print the config, then exit.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from disa_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import distributed  # pylint: disable=g-import-not-at-top
  from disa_jax.workflows.stage3 import Stage3Config, run_stage3  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  if _WORKDIR.value:
    config.workdir = _WORKDIR.value
  cfg = Stage3Config.from_config(config)
  if _DRY_RUN.value:
    print(json.dumps(config_lib.to_dict(cfg), indent=1))
    return
  distributed.initialize()  # no-op without a multi-process launcher's variables
  print(json.dumps(run_stage3(cfg), indent=1, default=str))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
