"""The prompt record every stage passes around, and its veRL row form.

`PromptRecord(prompt_id, prompt, ground_truth, data_source, extra)`:
- `prompt`: a plain string or a chat-message list `[{"role": ..., "content": ...}, ...]` (veRL);
- `ground_truth`: math: the answer string (or a list of acceptable answers); code: the list of
  stdin/stdout tests `[{"input", "output"}]`, or the HumanEval+ record (dict with `entry_point`);
- `extra`: everything else of the source row (`ability`, `problem`, `split`, `index`, ...).

`record.ability` is `extra["ability"]` ('math' or 'code'); `record.reward_meta()` builds the
per-sample metadata the reward registry (`disa_jax.rewards.get_reward_fn`) expects.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

__all__ = ["PromptRecord"]


@dataclasses.dataclass(frozen=True)
class PromptRecord:
  """One prompt with its verifier data (see module docstring)."""
  prompt_id: str
  prompt: str | list[dict[str, str]]
  ground_truth: Any
  data_source: str
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not isinstance(self.prompt_id, str) or not self.prompt_id:
      raise ValueError(f"PromptRecord.prompt_id must be a non-empty str, got {self.prompt_id!r}")
    if isinstance(self.prompt, list):
      if not self.prompt:
        raise ValueError(f"PromptRecord({self.prompt_id}).prompt is an empty chat-message list")
      for i, m in enumerate(self.prompt):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
          raise ValueError(f"PromptRecord({self.prompt_id}).prompt[{i}] must be a dict with "
                           f"'role' and 'content', got {m!r}")
        if not isinstance(m["role"], str) or not isinstance(m["content"], str):
          raise ValueError(f"PromptRecord({self.prompt_id}).prompt[{i}] role and content must be "
                           f"str, got role={m['role']!r}, content={m['content']!r}")
    elif not isinstance(self.prompt, str):
      raise ValueError(f"PromptRecord({self.prompt_id}).prompt must be str or a chat-message "
                       f"list, got {type(self.prompt).__name__}")
    text = self.prompt_text()
    if not text.strip() or text.strip() == "None":
      raise ValueError(f"PromptRecord({self.prompt_id}): the prompt text is empty or 'None': "
                       f"{text!r}")
    if self.ground_truth is None or (isinstance(self.ground_truth, str) and (
        not self.ground_truth.strip() or self.ground_truth.strip() == "None")):
      raise ValueError(f"PromptRecord({self.prompt_id}).ground_truth must be set (not None, empty "
                       f"or 'None'), got {self.ground_truth!r}")
    if not isinstance(self.data_source, str):
      raise ValueError(f"PromptRecord({self.prompt_id}).data_source must be str, got "
                       f"{self.data_source!r}")

  @property
  def ability(self) -> str:
    """'math' or 'code' (from `extra['ability']`; inferred from the ground truth otherwise)."""
    ab = self.extra.get("ability")
    if ab:
      return str(ab)
    gt = self.ground_truth
    if isinstance(gt, dict) and "entry_point" in gt:
      return "code"
    if isinstance(gt, list) and gt and isinstance(gt[0], dict) and "input" in gt[0]:
      return "code"
    return "math"

  def reward_meta(self) -> dict[str, Any]:
    """The metadata dict for `get_reward_fn(self.ability)` (ground truth / tests)."""
    if self.ability == "code":
      if isinstance(self.ground_truth, dict) and "entry_point" in self.ground_truth:
        return {"humaneval": self.ground_truth}
      if self.extra.get("func_name"):
        return {"tests": self.ground_truth, "func_name": self.extra["func_name"]}
      return {"tests": self.ground_truth}
    return {"ground_truth": self.ground_truth}

  def prompt_text(self) -> str:
    """The user content (the last user message of a chat prompt, or the prompt string)."""
    if isinstance(self.prompt, str):
      return self.prompt
    users = [m["content"] for m in self.prompt if m["role"] == "user"]
    return users[-1] if users else self.prompt[-1]["content"]

  def to_verl_row(self) -> dict[str, Any]:
    """The veRL row: `prompt` (chat list), `data_source`, `ability`, `reward_model`, `extra_info`.

    Code ground truths are stored JSON-encoded, as veRL's code datasets do.
    """
    prompt = self.prompt if isinstance(self.prompt, list) else [
      {"role": "user", "content": self.prompt}]
    extra = dict(self.extra)
    extra.setdefault("prompt_id", self.prompt_id)
    gt = self.ground_truth
    if self.ability == "code":  # veRL keeps code tests as a JSON string (one parquet type)
      gt = json.dumps(gt)
    return {"data_source": self.data_source, "prompt": prompt, "ability": self.ability,
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": extra}
