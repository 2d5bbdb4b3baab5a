"""Loading a checkpoint's tokenizer: `load_tokenizer(path)`, the one loader every workflow uses.

`transformers.AutoTokenizer` costs about 3 s of CPU to import (it pulls in torch where torch is
installed, as on every GPU node and in the test environment), paid by every process that loads a
tokenizer: the commands, their generation processes and every kill/resume worker of the tests. A
folder whose `tokenizer_config.json` names the plain fast tokenizer (`TokenizersBackend`, or
`PreTrainedTokenizerFast` as older transformers wrote it: what `save_pretrained` of a tokenizer
built from a `tokenizers.Tokenizer` writes, e.g. the main job's and the tests' tokenizers) loads
through that class directly, the same object AutoTokenizer would build, in about a third of the
time. Every other folder (model-specific classes such as Qwen2Tokenizer, or no config) goes
through `AutoTokenizer`.
"""
from __future__ import annotations

import json
import os
from typing import Any

PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_class_name(path: str | os.PathLike) -> str | None:
  """The ``tokenizer_class`` a local tokenizer folder declares, or None (no file or field)."""
  config = os.path.join(os.fspath(path), "tokenizer_config.json")
  try:
    with open(config, encoding="utf-8") as f:
      name = json.load(f).get("tokenizer_class")
  except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, AttributeError):
    return None
  return name if isinstance(name, str) else None


def load_tokenizer(path: str | os.PathLike, **kwargs: Any):
  """The tokenizer of the checkpoint folder (or hub name) ``path``, as `AutoTokenizer` loads it.

  Args:
    path: a local folder with the tokenizer files, or a name `AutoTokenizer` resolves.
    **kwargs: passed to ``from_pretrained``.
  """
  path = os.fspath(path)
  has_json = os.path.isfile(os.path.join(path, "tokenizer.json"))
  if has_json and tokenizer_class_name(path) in PLAIN_FAST_CLASSES:
    from transformers import PreTrainedTokenizerFast  # pylint: disable=g-import-not-at-top  (lazy: transformers is heavy)
    return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
  from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top  (heavy import)
  return AutoTokenizer.from_pretrained(path, **kwargs)
