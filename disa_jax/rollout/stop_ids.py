"""The token ids that end a sample: one function for every engine and stage.

A checkpoint names its end of generation in up to three places that need not agree: the tokenizer's
``eos_token`` (Qwen base and instruct: ``<|endoftext|>``), ``generation_config.json``'s
``eos_token_id`` (an int or a list; Qwen instruct: ``<|im_end|>`` and ``<|endoftext|>``), and, when
prompts are rendered with the chat template, the template's end-of-turn token (the special token
that follows an assistant message; ``<|im_end|>`` for Qwen). Stopping at only one of them lets a
response run on to the token limit. `stop_token_ids` returns their union; the engines stop at the
first occurrence of any of them (`SamplingParams.stop_token_ids`), and each stage records the set
in its summary.
"""
from __future__ import annotations

import json
import os
from typing import Any

GENERATION_CONFIG = "generation_config.json"
_MARK = "DISA_END_OF_TURN_PROBE"


def generation_config_eos(model_path: str) -> tuple[int, ...]:
  """``eos_token_id`` of ``<model_path>/generation_config.json`` (an int or a list); () if absent."""
  path = os.path.join(str(model_path), GENERATION_CONFIG)
  if not os.path.exists(path):
    return ()
  with open(path) as f:
    try:
      value = json.load(f).get("eos_token_id")
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
  if value is None:
    return ()
  values = value if isinstance(value, list) else [value]
  if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
    raise ValueError(f"{path}: eos_token_id must be an int >= 0 or a non-empty list of them, got "
                     f"{value!r}")
  return tuple(values)


def end_of_turn_id(tokenizer: Any) -> int | None:
  """The special token the chat template puts right after an assistant message, or None.

  Raises:
    ValueError: the tokenizer has no chat template.
  """
  if not getattr(tokenizer, "chat_template", None):
    raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, "
                     f"so it has no end-of-turn token (use rendering='plain')")
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}], tokenize=False)
  if _MARK not in text:
    return None
  suffix = text[text.rindex(_MARK) + len(_MARK):]
  ids = tokenizer.encode(suffix, add_special_tokens=False) if suffix.strip() else []
  special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
  return int(ids[0]) if ids and ids[0] in special else None


def stop_token_ids(tokenizer: Any, model_path: str, *, chat_template: bool) -> tuple[int, ...]:
  """The union of the tokenizer's eos, the generation config's eos and the end-of-turn token.

  Args:
    tokenizer: the model's transformers tokenizer.
    model_path: the model's HF directory (for ``generation_config.json``).
    chat_template: prompts are rendered with the chat template (adds its end-of-turn token).

  Returns:
    The ids in that order, without repeats.

  Raises:
    ValueError: none of the three names a token (naming the model path).
  """
  ids = []
  if tokenizer.eos_token_id is not None:
    ids.append(int(tokenizer.eos_token_id))
  ids.extend(generation_config_eos(model_path))
  if chat_template:
    eot = end_of_turn_id(tokenizer)
    if eot is not None:
      ids.append(eot)
  if not ids:
    raise ValueError(f"{model_path}: no stop token: the tokenizer has no eos_token and "
                     f"{GENERATION_CONFIG} has no eos_token_id; set sampling.stop_token_ids")
  return tuple(dict.fromkeys(ids))
