"""Prompt datasets: records, loaders for veRL and benchmark formats, the paper's prompt templates.

- `PromptRecord(prompt_id, prompt, ground_truth, data_source, extra)` (`records`).
- `load_prompts(path, fmt='auto')`, `save_prompts(records, path)` (`loaders`).
- `math_prompt`, `code_prompt`, `humaneval_prompt`, `chat_messages`, `render_chat`,
  `MissingChatTemplateError` (`templates`).
"""

from disa_jax.data import templates
from disa_jax.data.loaders import BENCHMARK_FORMATS
from disa_jax.data.loaders import FORMATS
from disa_jax.data.loaders import load_prompts
from disa_jax.data.loaders import save_prompts
from disa_jax.data.records import PromptRecord
from disa_jax.data.templates import chat_messages
from disa_jax.data.templates import code_prompt
from disa_jax.data.templates import humaneval_prompt
from disa_jax.data.templates import MissingChatTemplateError
from disa_jax.data.templates import math_prompt
from disa_jax.data.templates import render_chat

__all__ = ["templates", "BENCHMARK_FORMATS", "FORMATS", "load_prompts", "save_prompts",
           "PromptRecord", "chat_messages", "code_prompt", "humaneval_prompt", "math_prompt",
           "render_chat", "MissingChatTemplateError"]
