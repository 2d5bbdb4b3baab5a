"""The veRL prompt format, the one every task's prompt sets are stored in (`save_prompts` writes it).

A row: ``prompt`` (a chat-message list or a string), ``data_source``, ``reward_model.ground_truth``,
``extra_info`` (and ``ability``). The row's ability (``ability``, else ``extra_info.ability``; a
ground truth stored as a JSON test list is 'code'; else 'math') names its task, whose
`Task.ground_truth` checks the ground truth (code: the JSON-encoded test list decoded); a task
without one, or an ability no task registered, takes one answer or a list of acceptable answers.
Registered as format 'verl' when `disa_jax.tasks` is imported.
"""
from __future__ import annotations

from typing import Any, Mapping

from disa_jax.data import rows as rows_lib
from disa_jax.data.records import PromptRecord
from disa_jax.tasks import registry
from disa_jax.tasks.base import PromptFormat

__all__ = ["VERL"]


def _prompt(prompt: Any, where: str) -> str | list[dict[str, str]]:
  """A veRL `prompt`: a non-empty string or a chat list of {role, content} strings."""
  if hasattr(prompt, "tolist"):
    prompt = prompt.tolist()
  if not isinstance(prompt, list):
    return rows_lib.text(prompt, where)
  if not prompt:
    raise ValueError(f"{where} is an empty chat-message list")
  out = []
  for j, m in enumerate(prompt):
    if not isinstance(m, dict):
      raise ValueError(f"{where}[{j}] must be a {{role, content}} object, got {rows_lib.short(m)}")
    role = rows_lib.text(m.get("role"), f"{where}[{j}].role")
    content = m.get("content")
    if not isinstance(content, str):
      raise ValueError(f"{where}[{j}].content must be a string, got {type(content).__name__} "
                       f"{rows_lib.short(content)}")
    out.append({"role": role, "content": content})
  users = [m["content"] for m in out if m["role"] == "user"]
  rows_lib.text(users[-1] if users else out[-1]["content"], f"{where} (user message content)")
  return out


def _ground_truth(row: Mapping[str, Any], extra: dict[str, Any], where: str):
  """(ground truth, ability) of a veRL row, the ground truth checked by the ability's task."""
  rm = row.get("reward_model")
  if not isinstance(rm, dict):
    raise ValueError(f"{where}: reward_model must be an object with ground_truth, got "
                     f"{rows_lib.short(rm)} (row keys {sorted(row)})")
  gt = rm.get("ground_truth")
  ability = row.get("ability") or extra.get("ability")
  if ability is not None and not isinstance(ability, str):
    raise ValueError(f"{where}: ability must be a string, got {rows_lib.short(ability)}")
  if isinstance(gt, str) and gt.lstrip().startswith("[{"):  # a JSON test list: veRL's code rows
    ability = "code"
  ability = ability or "math"
  parse = registry.ground_truth_parser(ability) or rows_lib.answers
  return parse(gt, f"{where}: reward_model.ground_truth"), ability


def _record(row: Mapping[str, Any], i: int, src: str, where: str) -> PromptRecord:
  """The record of veRL row ``i`` (its own data source and prompt id when it has them)."""
  extra = row.get("extra_info")
  if extra is not None and not isinstance(extra, dict):
    raise ValueError(f"{where}: extra_info must be an object, got {rows_lib.short(extra)}")
  extra = dict(extra or {})
  gt, extra["ability"] = _ground_truth(row, extra, where)
  prompt = _prompt(row.get("prompt"), f"{where}: prompt")
  data_source = rows_lib.optional_text(row, "data_source", where) or src
  pid = str(extra.get("prompt_id") or rows_lib.row_id(extra, i, ("id", "index", "idx")))
  if not pid.startswith(f"{data_source}/"):  # a row that `save_prompts` wrote keeps its full id
    pid = f"{data_source}/{pid}"
  return PromptRecord(pid, prompt, gt, data_source, extra)


VERL = PromptFormat(name="verl", record=_record, detect_rank=0,
                    detect=lambda keys, base: "reward_model" in keys and "prompt" in keys)
registry.register_format(VERL)
