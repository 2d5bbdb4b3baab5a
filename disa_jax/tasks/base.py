"""The `Task`: what a prompt's ``ability`` names, its reward, its prompt formats and, when it has
one, its exact target; and the `PromptFormat` a task's prompt files are read with.

A task is keyed by one name, the same string in three places: the reward registry
(`disa_jax.rewards.register_reward`, the one registry of tasks), the ``ability`` field of prompt
records (`disa_jax.data.records.PromptRecord.ability`) and `registry.get_task`, which reads that registry's
entry. Its parts:

- the reward: `Task.reward_fn` resolves the registered reward of the task's name;
- the exact target (optional): `Task.correct_set`, ``(tokenizer, reward_meta) -> every correct
  response as token ids (stop token included)``, for a task whose correct set can be enumerated
  (the sum task, registered with its reward); None otherwise (math, code);
- `Task.measures`: the per-task measurement hook of Stage 3 and evaluation; the exact measures
  (`disa_jax.eval.exact.ExactTracker`) of a task with an exact target, None for the others;
- its prompts: `Task.formats`, the published file formats of its prompts (`PromptFormat`: rows ->
  `PromptRecord`s with the task's template applied), and `Task.ground_truth`, how a veRL row's
  ``reward_model.ground_truth`` of the task is checked (None: one answer or a list of answers,
  `disa_jax.data.rows.answers`).

Each task lives in one module of `disa_jax.tasks` (`math`, `code`, `sum`) that registers it with
`disa_jax.tasks.registry.register_task`; the registry looks tasks up by name and imports the
plugins that register more.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from disa_jax import rewards
from disa_jax.data.records import PromptRecord
from disa_jax.eval.exact import CorrectSetFn, ExactTargetConfig, ExactTracker
from disa_jax.rewards.graded import RewardFn
from disa_jax.scoring.batched import SequenceScorer

# (row, its index, data source, where (file and row, for errors)) -> the row's record
RowRecord = Callable[[Mapping[str, Any], int, str, str], PromptRecord]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PromptFormat:
  """A published prompt-file format: how its rows become `PromptRecord`s.

  Attributes:
    name: the format's name (``prompts_format`` in configs, ``fmt`` of `load_prompts`).
    record: ``(row, index, data_source, where) -> the row's record``; a malformed row is refused
      naming ``where`` (the file and the row), the field and its value.
    detect: ``(keys of the first row's non-null fields, file base name in lower case) -> whether
      the rows are in this format`` (format 'auto').
    detect_rank: the order in which 'auto' tries the formats (lowest first).
    benchmarks: the benchmark names read in this format (a benchmark name is a valid ``fmt``).
  """
  name: str
  record: RowRecord
  detect: Callable[[frozenset[str], str], bool]
  detect_rank: int
  benchmarks: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Task:
  """A task: its name (reward-registry key and prompt ability), its prompt formats and its
  optional exact target.

  Attributes:
    name: the reward-registry key and the ``ability`` of the task's prompt records.
    correct_set: ``(tokenizer, reward_meta) -> [C] correct responses (token ids, stop token
      included)`` when the task's correct set can be enumerated; None when it cannot.
    formats: the prompt-file formats of the task's published prompt sets.
    ground_truth: ``(value, where) -> ground truth`` of a veRL row of the task (None: one answer or
      a list of acceptable answers).
  """
  name: str
  correct_set: CorrectSetFn | None = None
  formats: tuple[PromptFormat, ...] = ()
  ground_truth: Callable[[Any, str], Any] | None = None

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name:
      raise ValueError(f"Task.name must be a non-empty str, got {self.name!r}")
    if self.correct_set is not None and not callable(self.correct_set):
      raise ValueError(f"Task {self.name!r}: correct_set must be callable or None, got "
                       f"{type(self.correct_set).__name__}")

  @property
  def ability(self) -> str:
    """The ``ability`` field of the task's prompt records (the task's name)."""
    return self.name

  @property
  def has_exact_target(self) -> bool:
    """Whether the task's correct set can be enumerated (`correct_set` is set)."""
    return self.correct_set is not None

  def reward_fn(self) -> RewardFn:
    """The task's registered reward (`disa_jax.rewards.get_reward_fn` of its name).

    Returns:
      ``(responses [n], metas [n]) -> Graded``.
    """
    return rewards.get_reward_fn(self.name)

  def measures(self, cfg: ExactTargetConfig, tokenizer: Any, prompts: Sequence[Sequence[int]],
               metas: Sequence[Mapping[str, Any]], ref_scorer: Callable[[], SequenceScorer],
               max_tokens: int) -> ExactTracker | None:
    """The task's measurement object on ``prompts`` (Stage 3's and evaluation's hook).

    Args:
      cfg: the ``exact_target`` config section (beta, kl_samples, seed).
      tokenizer: the shared tokenizer (decodes samples, builds the correct sets).
      prompts: ``[P]`` prompt token ids.
      metas: ``[P]`` their reward metas.
      ref_scorer: ``() -> SequenceScorer`` of pi_ref; called only for a task with an exact
        target (it loads the reference model).
      max_tokens: the response limit of the policy's sampling.

    Returns:
      The `ExactTracker` of the prompts, or None when the task has no exact target.
    """
    if self.correct_set is None:
      return None
    return ExactTracker(cfg, tokenizer, prompts, metas, self.correct_set, self.reward_fn(),
                        ref_scorer(), max_tokens=max_tokens)

