r"""Writes the paper's training sets and benchmarks where the configs read them, with provenance.

  python launch/prepare_data.py --set=dapo-17k-processed            # from the hub (online)
  python launch/prepare_data.py --set=math500 --source=/dl/MATH-500  # a downloaded dataset dir
  python launch/prepare_data.py --set=aime24 --source=aime24.jsonl --output=data/benchmarks/aime24.jsonl

--set is one of dapo-17k-processed, deepcoder (training sets: veRL parquet), aime24, aime25,
amc23, math500, humanevalplus (benchmarks: their rows as jsonl). --source is a local file, a Hugging
Face dataset directory or a hub name (default: the set's hub name); a source that looks like a local
path and is missing is an error naming it, and a hub name is read only when the hub answers (else
the command stops at once: pass a downloaded copy as --source, or HF_HUB_OFFLINE=1 for the local
cache). --output defaults to the path the configs read. Writes ``<output>.provenance.json``
beside it and prints it. A malformed row stops the command, naming the row and the field. ``--dry_run`` checks
the set, the source and the output and prints the plan, reading and writing nothing. See
`disa_jax.workflows.prepare_data`; then split the training sets with launch/split_validation.py.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import flags  # noqa: E402

from disa_jax import launcher  # noqa: E402
from disa_jax.workflows.prepare_data import SETS, plan, prepare  # noqa: E402
from disa_jax.workflows.preflight import require_writable  # noqa: E402

_SET = flags.DEFINE_enum("set", None, sorted(SETS), "The set to prepare.")
_SOURCE = flags.DEFINE_string("source", "", "Local file, HF dataset directory or hub name "
                              "('' = the set's hub name).")
_OUTPUT = flags.DEFINE_string("output", "", "Output file ('' = the path the configs read).")
_CONFIGS = flags.DEFINE_list("hf_configs", None, "Dataset configs to concatenate (default: the "
                             "set's).")
_SPLIT = flags.DEFINE_string("split", None, "Dataset split (default: the set's).")
_REVISION = flags.DEFINE_string("revision", None, "Hub revision (branch, tag or commit).")
launcher.define_run_flags()


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]} (flags are --name=value)")
  require_writable({"--output": _OUTPUT.value or SETS[_SET.value].output})
  command = plan if flags.FLAGS.dry_run else prepare  # the dry run: every check, nothing read
  print(json.dumps(command(_SET.value, _SOURCE.value, _OUTPUT.value, configs=_CONFIGS.value,
                           split=_SPLIT.value, revision=_REVISION.value), indent=1))


if __name__ == "__main__":
  flags.mark_flag_as_required("set")
  launcher.run_app(main)
