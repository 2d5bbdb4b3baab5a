r"""Splits a held-out validation subset from the training prompts (the paper's checkpoint selection).

  python launch/split_validation.py --input=data/dapo-17k-processed.parquet \
      --train=data/dapo-17k-processed.train.parquet --validation=data/dapo-17k-processed.val.parquet \
      --size=500 --seed=0

The split is by content hash (seeded): reruns and reordered copies of the input give the same
validation prompts. Writes both files and ``<validation>.manifest.json``; prints the manifest. The
paper configs read these paths (`configs/common.py`). ``--dry_run`` checks the input, the outputs
(suffix, writable, not the input) and the size, prints the plan and writes nothing. See
`disa_jax.workflows.split_validation`.
"""
from __future__ import annotations

import json
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from absl import flags  # noqa: E402

from disa_jax import codec, launcher  # noqa: E402
from disa_jax.workflows.split_validation import manifest_path, split_validation  # noqa: E402
from disa_jax.workflows.preflight import require_writable  # noqa: E402

_INPUT = flags.DEFINE_string("input", None, "Training prompt file (veRL parquet/jsonl, ...).")
_TRAIN = flags.DEFINE_string("train", None, "Output: the training part (.parquet or .jsonl).")
_VALIDATION = flags.DEFINE_string("validation", None, "Output: the validation part.")
_SIZE = flags.DEFINE_integer("size", None, "Validation prompts.")
_SEED = flags.DEFINE_integer("seed", None, "Seed of the split.")
_FORMAT = flags.DEFINE_string("format", "auto", "Loader format of --input.")
launcher.define_run_flags()


def plan() -> dict:
  """What the command would do, its inputs and outputs checked (nothing read or written)."""
  if not os.path.isfile(_INPUT.value):
    raise FileNotFoundError(f"--input={_INPUT.value!r}: no such file")
  if _SIZE.value < 1:
    raise ValueError(f"--size={_SIZE.value}: must be >= 1")
  outputs = {"--train": _TRAIN.value, "--validation": _VALIDATION.value}
  for flag, out in outputs.items():
    if not out.endswith((".parquet", ".jsonl")):
      raise ValueError(f"{flag}={out!r}: must end in .parquet or .jsonl")
    if os.path.abspath(out) == os.path.abspath(_INPUT.value):
      raise ValueError(f"{flag}={out!r} is the input file; choose another path")
  require_writable(outputs)
  return {"input": os.path.abspath(_INPUT.value), "format": _FORMAT.value, "size": _SIZE.value,
          "seed": _SEED.value, **{k.lstrip("-"): os.path.abspath(v) for k, v in outputs.items()},
          "manifest": os.path.abspath(manifest_path(_VALIDATION.value))}


def main(argv):
  if len(argv) > 1:
    raise ValueError(f"unexpected arguments: {argv[1:]} (flags are --name=value)")
  steps = plan()
  if flags.FLAGS.dry_run:
    print(json.dumps(steps, indent=1))
    return
  manifest = split_validation(_INPUT.value, _TRAIN.value, _VALIDATION.value, size=_SIZE.value,
                              seed=_SEED.value, fmt=_FORMAT.value)
  out = codec.encode(manifest)
  out["validation_prompt_ids"] = f"{len(manifest.validation_prompt_ids)} ids (in the manifest file)"
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  flags.mark_flags_as_required(["input", "train", "validation", "size", "seed"])
  launcher.run_app(main)
