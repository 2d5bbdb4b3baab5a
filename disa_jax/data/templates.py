"""Chat prompts: the message list veRL stores, and its rendering under a tokenizer's chat template.

Each task's own template (the text of the user message) lives with the task
(`disa_jax.tasks.math.math_prompt`, `disa_jax.tasks.code.code_prompt`, ...).

`chat_messages(text, system=None)` gives the chat-message list veRL stores in its `prompt` column;
`render_chat(tokenizer, messages)` turns it into the model's text with the tokenizer's chat
template; a tokenizer without one raises `MissingChatTemplateError` naming it (base models: set
`use_chat_template=False`, which prompts with the plain user text, `PromptRecord.prompt_text()`).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
  "chat_messages",
  "render_chat",
  "MissingChatTemplateError",
]


def chat_messages(text: str, system: str | None = None) -> list[dict[str, str]]:
  """`[{"role": "system", ...}?, {"role": "user", "content": text}]`."""
  msgs = [] if system is None else [{"role": "system", "content": system}]
  msgs.append({"role": "user", "content": text})
  return msgs


class MissingChatTemplateError(ValueError):
  """A chat prompt was to be rendered with a tokenizer that has no chat template."""


def _tokenizer_name(tokenizer: Any) -> str:
  return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def render_chat(tokenizer: Any, messages: Sequence[dict[str, str]] | str, *,
                add_generation_prompt: bool = True) -> str:
  """The prompt text for `messages` under the tokenizer's chat template.

  A plain string is returned unchanged (base-model prompting without a template).

  Args:
    tokenizer: a `transformers` tokenizer with a chat template.
    messages: chat messages or a plain prompt string.
    add_generation_prompt: append the assistant turn header.

  Returns:
    The text to tokenize.

  Raises:
    MissingChatTemplateError: the tokenizer has no chat template (the message names it and says to
      set `use_chat_template=False`).
  """
  if isinstance(messages, str):
    return messages
  name = _tokenizer_name(tokenizer)
  fix = (f"tokenizer {name!r} has no chat template, so chat prompts cannot be rendered with it; "
         "set use_chat_template=False to prompt with the plain user text "
         "(PromptRecord.prompt_text()), or give the tokenizer a chat template")
  if hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
    raise MissingChatTemplateError(fix)
  try:
    return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
  except ValueError as e:
    if "chat_template" in str(e) or "chat template" in str(e):
      raise MissingChatTemplateError(f"{fix} ({e})") from e
    raise
