"""Prompt data: records, prompt files as rows, chat templates, tokenizers, packing.

- `PromptRecord(prompt_id, prompt, ground_truth, data_source, extra)` (`records`).
- `read_rows(path)`, `save_prompts(records, path)` and the checked fields of a row (`rows`); the
  prompt formats that turn rows into records are the tasks' (`disa_jax.tasks.load_prompts`).
- `chat_messages`, `render_chat`, `MissingChatTemplateError` (`templates`).
"""

from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.data.rows import read_rows
from disa_jax.data.rows import save_prompts
from disa_jax.data.templates import chat_messages
from disa_jax.data.templates import MissingChatTemplateError
from disa_jax.data.templates import render_chat

__all__ = ["templates", "read_rows", "save_prompts", "PromptRecord", "chat_messages",
           "render_chat", "MissingChatTemplateError"]
