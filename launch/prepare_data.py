r"""Writes the paper's training sets and benchmarks where the configs read them, with provenance.

  python launch/prepare_data.py --set=dapo-17k-processed            # from the hub (online)
  python launch/prepare_data.py --set=math500 --source=/dl/MATH-500  # a downloaded dataset dir
  python launch/prepare_data.py --set=aime24 --source=aime24.jsonl --output=data/benchmarks/aime24.jsonl

--set is one of dapo-17k-processed, deepcoder (training sets: veRL parquet), aime24, aime25,
amc23, math500, humanevalplus (benchmarks: their rows as jsonl). --source is a local file, a Hugging
Face dataset directory or a hub name (default: the set's hub name); --output defaults to the path
the configs read. Writes ``<output>.provenance.json`` beside it and prints it. A malformed row
stops the command, naming the row and the field. See `disa_jax.data.prepare`; then split the
training sets with launch/split_validation.py.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from disa_jax.data.prepare import SETS, prepare  # noqa: E402

_SET = flags.DEFINE_enum("set", None, sorted(SETS), "The set to prepare.")
_SOURCE = flags.DEFINE_string("source", "", "Local file, HF dataset directory or hub name "
                              "('' = the set's hub name).")
_OUTPUT = flags.DEFINE_string("output", "", "Output file ('' = the path the configs read).")
_CONFIGS = flags.DEFINE_list("hf_configs", None, "Dataset configs to concatenate (default: the "
                             "set's).")
_SPLIT = flags.DEFINE_string("split", None, "Dataset split (default: the set's).")
_REVISION = flags.DEFINE_string("revision", None, "Hub revision (branch, tag or commit).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  print(json.dumps(prepare(_SET.value, _SOURCE.value, _OUTPUT.value, configs=_CONFIGS.value,
                           split=_SPLIT.value, revision=_REVISION.value), indent=1))


if __name__ == "__main__":
  flags.mark_flag_as_required("set")
  app.run(main)
