"""How a prompt record becomes the token ids a model sees: the one `encode_prompt`.

Stages 1, 2 and 3 and evaluation all tokenise prompts here, so the reference embeddings the anchor
was fitted on (Stage 2) and the ones it is queried with in Stage 3 come from the same ids. The
rendering is recorded with the Stage 1 data and in the anchor's `EmbeddingSpec`, and Stage 3
refuses an anchor fitted under another one.

Renderings (``RENDERINGS``):
  'chat_template'  the record's messages through the tokenizer's chat template, with the
                   generation prompt (an instruct or chat-tuned model);
  'plain'          the record's user text as is (`PromptRecord.prompt_text`), e.g. a base model
                   or a tokenizer without a chat template.
Text is tokenised without added special tokens (the template already holds them).
"""
from __future__ import annotations

from typing import Any

from disa_jax.data import templates
from disa_jax.data.records import PromptRecord

RENDERINGS = ("chat_template", "plain")


def check_rendering(rendering: str, where: str = "rendering") -> None:
  if rendering not in RENDERINGS:
    raise ValueError(f"{where} must be one of {RENDERINGS}, got {rendering!r}")


def render_prompt(tokenizer: Any, record: PromptRecord, rendering: str) -> str:
  """The prompt text of ``record`` as ``tokenizer``'s model sees it under ``rendering``."""
  check_rendering(rendering)
  if rendering == "chat_template":
    return templates.render_chat(tokenizer, record.prompt)
  return record.prompt_text()


def encode_prompt(tokenizer: Any, record: PromptRecord, rendering: str, *,
                  max_len: int) -> tuple[int, ...]:
  """The token ids of ``record``'s prompt.

  Args:
    tokenizer: a transformers tokenizer.
    record: the prompt record.
    rendering: one of ``RENDERINGS``.
    max_len: the longest prompt allowed (tokens).

  Returns:
    The token ids (no special tokens added beyond the rendering's own).

  Raises:
    ValueError: naming the prompt id, when the prompt tokenises to nothing or to more than
      ``max_len`` tokens.
  """
  text = render_prompt(tokenizer, record, rendering)
  ids = tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])
  if not ids:
    raise ValueError(f"prompt {record.prompt_id!r}: tokenises to nothing under rendering "
                     f"{rendering!r}")
  if len(ids) > max_len:
    raise ValueError(f"prompt {record.prompt_id!r}: {len(ids)} tokens > max_prompt_len={max_len} "
                     f"(rendering {rendering!r})")
  return ids
