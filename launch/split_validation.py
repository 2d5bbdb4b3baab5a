r"""Splits a held-out validation subset from the training prompts (the paper's checkpoint selection).

  python launch/split_validation.py --input=data/dapo-17k-processed.parquet \
      --train=data/dapo-17k-processed.train.parquet --validation=data/dapo-17k-processed.val.parquet \
      --size=500 --seed=0

The split is by content hash (seeded): reruns and reordered copies of the input give the same
validation prompts. Writes both files and ``<validation>.manifest.json``; prints the manifest. The
paper configs read these paths (`configs/common.py`). See `disa_jax.data.split`.
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

from disa_jax.data.split import split_validation  # noqa: E402

_INPUT = flags.DEFINE_string("input", None, "Training prompt file (veRL parquet/jsonl, ...).")
_TRAIN = flags.DEFINE_string("train", None, "Output: the training part (.parquet or .jsonl).")
_VALIDATION = flags.DEFINE_string("validation", None, "Output: the validation part.")
_SIZE = flags.DEFINE_integer("size", None, "Validation prompts.")
_SEED = flags.DEFINE_integer("seed", None, "Seed of the split.")
_FORMAT = flags.DEFINE_string("format", "auto", "Loader format of --input.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  manifest = split_validation(_INPUT.value, _TRAIN.value, _VALIDATION.value, size=_SIZE.value,
                              seed=_SEED.value, fmt=_FORMAT.value)
  out = manifest.to_json()
  out["validation_prompt_ids"] = f"{len(manifest.validation_prompt_ids)} ids (in the manifest file)"
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  flags.mark_flags_as_required(["input", "train", "validation", "size", "seed"])
  app.run(main)
