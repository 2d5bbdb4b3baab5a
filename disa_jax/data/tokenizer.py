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

transformers resolves its top-level names lazily, and not thread-safely: a name first imported by
several threads at once raises ImportError in all but one (the seeds of `disa_jax.rl.seed_batch`
load their tokenizers in threads of one fresh process). `transformers_class` imports under a lock.
"""
from __future__ import annotations

import importlib
import json
import os
import threading
from typing import Any

PLAIN_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_IMPORT_LOCK = threading.Lock()


def transformers_class(name: str) -> Any:
  """``transformers.<name>``, imported on first use (transformers is heavy) under a lock (its lazy
  module is not thread-safe: the module docstring)."""
  with _IMPORT_LOCK:
    return getattr(importlib.import_module("transformers"), name)


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
    return transformers_class("PreTrainedTokenizerFast").from_pretrained(path, **kwargs)
  return transformers_class("AutoTokenizer").from_pretrained(path, **kwargs)
