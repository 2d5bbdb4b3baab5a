"""The prompt file pinned across stages: what Stage 1 graded is what Stages 2 and 3 read.

Stage 1 grades its proposal samples against the prompts' answers and records the prompt file's
content fingerprint (``prompts_path.sha256`` in its ``stage1_identity.json``). Its labels (Stage 2's
anchor targets) and its stored rewards (Stage 3's replayed rows, `disa_jax.rl.replay`) are only true
for those answers: with the answers replaced after Stage 1, a DISA run replaying Stage 1 exited 0
with replay accuracy 1.0, though no Stage 1 sample holds the new answers.

`check_stage1_prompts` therefore refuses, before a stage reads any weights,

- Stage 1's prompt file changed since Stage 1 (Stage 2, which re-reads it; Stage 3, whose training
  file is it or a copy of it);
- a Stage 3 training file other than Stage 1's whose prompts shared with it have other text or
  answers (a subset of Stage 1's prompts, such as the main job's training split, is checked prompt
  by prompt against Stage 1's unchanged file);

each with one `ChangedPromptsError` line naming the file and both fingerprints (a run-time user
error: ``error: ...`` and exit code 2). The way out is to rerun Stage 1 on the new file (and Stage 2
on its output), or to restore the file Stage 1 read. A Stage 1 dataset without an identity file
(made by other tools) records no fingerprint, and is not checked.
"""
from __future__ import annotations

import json
from typing import Any

from disa_jax import paths
from disa_jax.checkpoint import identity
from disa_jax.tasks.prompts import load_prompts

_REDO = ("rerun Stage 1 on the new file (and Stage 2 on its output), or restore the file Stage 1 "
         "read")


class ChangedPromptsError(identity.IdentityMismatchError):
  """A stage's prompt file differs from the one Stage 1 graded (one line, see the module
  docstring)."""

  def __init__(self, message: str):  # pylint: disable=super-init-not-called
    ValueError.__init__(self, message)
    self.message = message

  def __str__(self) -> str:
    return self.message

  def __reduce__(self):  # (pickled back from a worker process)
    return type(self), (self.message,)


def _stage1_record(stage1_path: str) -> tuple[dict[str, Any], paths.AnyPath] | None:
  """Stage 1's identity and the file it is in, or None where the dataset records none."""
  ident_file = paths.as_path(stage1_path).parent / "stage1_identity.json"
  if not ident_file.exists():
    return None
  ident = json.loads(ident_file.read_text())
  if "prompts_path.sha256" not in ident:
    return None
  return ident, ident_file


def _stage1_format(stage1_path: str) -> str:
  config = paths.as_path(stage1_path).parent / "stage1_config.json"
  return json.loads(config.read_text()).get("prompts_format", "auto") if config.exists() else "auto"


def _differing_prompts(run_path: str, run_format: str, s1_path: str, s1_format: str) -> list[str]:
  """The prompt ids in both files whose text or answer differ."""
  s1 = {r.prompt_id: (r.prompt, r.ground_truth) for r in load_prompts(s1_path, s1_format)}
  return [r.prompt_id for r in load_prompts(run_path, run_format)
          if r.prompt_id in s1 and s1[r.prompt_id] != (r.prompt, r.ground_truth)]


def check_stage1_prompts(stage1_path: str, *, field: str = "", prompts_path: str = "",
                         prompts_format: str = "auto") -> None:
  """Refuses prompts other than those Stage 1 graded (see the module docstring).

  Args:
    stage1_path: the Stage 1 dataset (its directory holds ``stage1_identity.json``).
    field: the config field naming the run's own prompt file ('' = none: Stage 2 reads Stage 1's).
    prompts_path, prompts_format: that file and its format (Stage 3's ``data.train_path``).

  Raises:
    ChangedPromptsError: one line naming the file, the fingerprint Stage 1 recorded and the
      file's now.
  """
  found = _stage1_record(stage1_path)
  if found is None:
    return
  ident, ident_file = found
  recorded, s1_path = ident["prompts_path.sha256"], ident["prompts_path"]
  mine = identity.fingerprint(prompts_path) if prompts_path else None
  if mine == recorded:
    return  # Stage 1's file, or a copy of it
  run = f"{field}={prompts_path!r}: " if prompts_path else ""
  if not paths.as_path(s1_path).exists():
    raise ChangedPromptsError(
        f"{run}Stage 1's prompt file {s1_path!r} no longer exists (sha256 {recorded} recorded in "
        f"{ident_file})" + (f" and this file holds other content (sha256 {mine}); " if mine else "; ")
        + _REDO)
  now = identity.fingerprint(s1_path)
  if now != recorded:
    raise ChangedPromptsError(
        f"{run}the prompt file {s1_path!r} changed since Stage 1 graded its samples (sha256 "
        f"{recorded} recorded in {ident_file}, {now} now): Stage 1's labels and stored rewards "
        f"hold the old answers; {_REDO}")
  if prompts_path:
    differ = _differing_prompts(prompts_path, prompts_format, s1_path,
                                _stage1_format(stage1_path))
    if differ:
      raise ChangedPromptsError(
          f"{run}{len(differ)} prompt(s) differ in text or answer from Stage 1's prompt file "
          f"{s1_path!r} (sha256 {recorded}, unchanged; this file sha256 {mine}), e.g. "
          f"{differ[:5]}: Stage 1's labels and stored rewards hold the old answers; {_REDO}")
