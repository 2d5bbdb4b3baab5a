r"""Stage 3 entry point: DISA / FlowRL / GRPO / GSPO training.

  python launch/train.py --config=configs/stage3_paper.py:disa,qwen2.5-7b,math \
      --config.model.policy_path=/models/Qwen2.5-7B --config.data.anchor_path=/anchors/q25-math \
      --workdir=/runs/disa-q25-math

A thin flag parser around `disa_jax.workflows.stage3.run_stage3`: the ConfigDict (with
``--config.field=value`` overrides) is converted once into the typed `Stage3Config`, which validates
every field. Re-running with the same ``--workdir`` resumes from its latest checkpoint.
``--dry_run`` checks the config, mesh, lengths (against the policy's context), paths, anchor and
workdir (writable; a rerun's settings against the run it would resume) without loading weights.
"""
from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

from absl import flags  # noqa: E402

from disa_jax import launcher  # noqa: E402
from disa_jax.parallel import distributed  # noqa: E402
from disa_jax.workflows.stage3 import Stage3Config, run_stage3  # noqa: E402

_CONFIG = launcher.define_flags("Stage 3 config file (configs/stage3_paper.py:...).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (sets config.workdir).")


def convert(config):
  distributed.initialize()  # no-op without a multi-process launcher's variables
  if _WORKDIR.value:
    config.workdir = _WORKDIR.value
  return Stage3Config.from_config(config)


def execute(cfg):
  return run_stage3(cfg).to_json()


if __name__ == "__main__":
  launcher.run(_CONFIG, convert, execute)
