"""Prompt templates of the paper's setup (math: boxed final answer; code: a fenced Python program).

The paper does not print its templates. The math instruction is the standard Qwen2.5-Math one
("Please reason step by step, and put your final answer within \\boxed{}.", appended to the problem;
`MATH_INSTRUCTION_DEEPSCALER` is the DeepScaleR/rllm variant); the code instruction follows the
DeepCoder / LiveCodeBench convention (a complete Python program reading stdin and writing stdout, in
a ```python fenced block, or the given starter code completed for function-call problems).

`chat_messages(text, system=None)` gives the chat-message list veRL stores in its `prompt` column;
`render_chat(tokenizer, messages)` turns it into the model's text with the tokenizer's chat
template; a tokenizer without one raises `MissingChatTemplateError` naming it (base models: set
`use_chat_template=False`, which prompts with the plain user text, `PromptRecord.prompt_text()`).
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = [
  "MATH_INSTRUCTION",
  "MATH_INSTRUCTION_DEEPSCALER",
  "CODE_STDIO_INSTRUCTION",
  "CODE_FUNCTION_INSTRUCTION",
  "math_prompt",
  "code_prompt",
  "humaneval_prompt",
  "chat_messages",
  "render_chat",
  "MissingChatTemplateError",
]

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
MATH_INSTRUCTION_DEEPSCALER = (
  "Let's think step by step and output the final answer within \\boxed{}.")

CODE_STDIO_INSTRUCTION = (
  "Write a complete Python 3 program that solves the problem above. It must read the input from "
  "standard input and write the answer to standard output. Put the whole program in a single "
  "```python code block.")

CODE_FUNCTION_INSTRUCTION = (
  "Complete the following Python code so that it solves the problem above. Return the complete "
  "code, including the given signature, in a single ```python code block.")


def math_prompt(problem: str, instruction: str = MATH_INSTRUCTION) -> str:
  """The math prompt: the problem followed by the boxed-answer instruction.

  Args:
    problem: the problem statement.
    instruction: the instruction appended after a blank line.

  Returns:
    The user-message text.
  """
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"problem must be a non-empty str, got {problem!r}")
  return f"{problem.strip()}\n\n{instruction}"


def code_prompt(problem: str, starter_code: str | None = None) -> str:
  """The code prompt: stdin/stdout program, or completion of `starter_code` when given.

  Args:
    problem: the problem statement.
    starter_code: a function/class signature to complete (LiveCodeBench functional problems).

  Returns:
    The user-message text.
  """
  if not isinstance(problem, str) or not problem.strip():
    raise ValueError(f"problem must be a non-empty str, got {problem!r}")
  if starter_code:
    return (f"{problem.strip()}\n\n{CODE_FUNCTION_INSTRUCTION}\n\n```python\n"
            f"{starter_code.rstrip()}\n```")
  return f"{problem.strip()}\n\n{CODE_STDIO_INSTRUCTION}"


def humaneval_prompt(prompt: str) -> str:
  """The prompt for a HumanEval(+) task: complete the given function.

  Args:
    prompt: the task's `prompt` field (imports, signature, docstring).

  Returns:
    The user-message text.
  """
  return ("Complete the following Python function. Return the complete function, including its "
          f"signature and any imports, in a single ```python code block.\n\n```python\n"
          f"{prompt.rstrip()}\n```")


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
