"""The main job's preference among correct answers: `ConditionalKLs`, persisted as conditional_kl.json.

Per evaluated model (a row: the job's name for it -> its checkpoint), per prompt, KL(pi|c || pi~|c)
(the target's preference among correct answers; pi~|c = pi_ref|c, the reward being binary) and
KL(pi|c || p_T|c) (the proposal's), `disa_jax.eval.conditional.conditional_kl`; their means over the
training prompts and over the held-out prompts. `SumJob.conditional_kls` computes them and reuses a
cached row only while its checkpoint is the one it was computed from (`model_identity`).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Mapping

import numpy as np

from disa_jax import artifacts, codec


def model_identity(path: str | Path) -> str:
  """The identity of the checkpoint directory ``path``: its resolved path and a digest of the names,
  sizes and modification times of its files (a model saved again at the same path changes it).

  Raises:
    FileNotFoundError: ``path`` is not a directory.
  """
  root = Path(path).resolve()
  if not root.is_dir():
    raise FileNotFoundError(f"model_identity: the checkpoint {str(path)!r} is not a directory")
  digest = hashlib.sha256()
  for f in sorted(p for p in root.rglob("*") if p.is_file()):
    st = f.stat()
    digest.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
  return f"{root}#{digest.hexdigest()[:16]}"


@dataclasses.dataclass(frozen=True, eq=False)
class ConditionalKL:
  """One row's preference among correct answers, per prompt of the job (compare two with
  `artifacts.fields_equal`: its fields are arrays).

  Attributes:
    model_path: the checkpoint scored.
    model_identity: its `model_identity` when scored (the cache key).
    kl_target: ``[P]`` KL(pi|c || pi~|c) per prompt.
    kl_proposal: ``[P]`` KL(pi|c || p_T|c) per prompt.
    heldout: ``[P]`` bool, the prompts held out of Stage 3 (all False without a split).
  """
  model_path: str
  model_identity: str
  kl_target: np.ndarray = codec.field(key="kl_target_correct")
  kl_proposal: np.ndarray = codec.field(key="kl_proposal_correct")
  heldout: np.ndarray = codec.field(stored=False)  # (ConditionalKLs' split)

  def __post_init__(self):
    for name in ("kl_target", "kl_proposal"):
      object.__setattr__(self, name, np.asarray(getattr(self, name), np.float64))
    object.__setattr__(self, "heldout", np.asarray(self.heldout, bool))
    shapes = {n: getattr(self, n).shape for n in ("kl_target", "kl_proposal", "heldout")}
    if len(set(shapes.values())) != 1 or len(shapes["heldout"]) != 1 or not self.heldout.size:
      raise ValueError(f"ConditionalKL of {self.model_path!r} needs [P] arrays of one shape, "
                       f"P >= 1, got shapes {shapes}")
    if self.heldout.all():
      raise ValueError(f"ConditionalKL of {self.model_path!r}: every prompt is held out, so no "
                       "training prompt is left for the means")

  def _mean(self, values: np.ndarray, heldout: bool) -> float | None:
    picked = values[self.heldout] if heldout else values[~self.heldout]
    return float(picked.mean()) if picked.size else None

  @property
  def kl_target_mean(self) -> float:
    """Mean KL(pi|c || pi~|c) over the training prompts (all prompts without a split)."""
    return self._mean(self.kl_target, False)

  @property
  def kl_proposal_mean(self) -> float:
    """Mean KL(pi|c || p_T|c) over the training prompts (all prompts without a split)."""
    return self._mean(self.kl_proposal, False)

  @property
  def kl_target_mean_heldout(self) -> float | None:
    """Mean KL(pi|c || pi~|c) over the held-out prompts (None without any)."""
    return self._mean(self.kl_target, True)

  @property
  def kl_proposal_mean_heldout(self) -> float | None:
    """Mean KL(pi|c || p_T|c) over the held-out prompts (None without any)."""
    return self._mean(self.kl_proposal, True)

  def means(self) -> dict[str, float]:
    """The report's entry: the training means, and the held-out means when there are any."""
    out = {"kl_target_correct_mean": self.kl_target_mean,
           "kl_proposal_correct_mean": self.kl_proposal_mean}
    if self.heldout.any():
      out |= {"kl_target_correct_mean_heldout": self.kl_target_mean_heldout,
              "kl_proposal_correct_mean_heldout": self.kl_proposal_mean_heldout}
    return out

  json_extra = means  # (`codec.encode` writes the means after the fields)


@dataclasses.dataclass(frozen=True, eq=False)
class ConditionalKLs:
  """Every row's `ConditionalKL`, against one target and one proposal.

  Attributes:
    path: the conditional_kl.json it is saved to.
    prompt_ids: ``[P]`` the prompts, in the order of the rows' arrays.
    heldout_prompt_ids: the held-out ones among them (sorted; () without a split).
    reference_identity: `model_identity` of pi_ref (the target's preference pi~|c = pi_ref|c).
    proposal_identity: `model_identity` of p_T.
    rows: row name -> its `ConditionalKL`.
  """
  path: Path = codec.field(stored=False)
  prompt_ids: tuple[str, ...]
  heldout_prompt_ids: tuple[str, ...]
  reference_identity: str
  proposal_identity: str
  rows: Mapping[str, ConditionalKL]

  FILE = "conditional_kl.json"

  def __post_init__(self):
    unknown = sorted(set(self.heldout_prompt_ids) - set(self.prompt_ids))
    if unknown:
      raise ValueError(f"ConditionalKLs: heldout_prompt_ids {unknown} are not among prompt_ids")
    mask = self.heldout_mask()
    for name, row in self.rows.items():
      if row.kl_target.shape != mask.shape or not np.array_equal(row.heldout, mask):
        raise ValueError(f"ConditionalKLs: row {name!r} has {row.kl_target.shape} values or a "
                         f"held-out split other than that of its {len(self.prompt_ids)} prompts")

  def heldout_mask(self) -> np.ndarray:
    """``[P]`` bool: which of `prompt_ids` are held out."""
    held = set(self.heldout_prompt_ids)
    return np.asarray([p in held for p in self.prompt_ids], bool)

  def report_section(self) -> dict[str, dict[str, float]]:
    """report.json's ``conditional_kl``: per row, `ConditionalKL.means`."""
    return {name: row.means() for name, row in self.rows.items()}

  def save(self) -> None:
    codec.save(self, self.path)

  @classmethod
  def load(cls, path: str | Path) -> "ConditionalKLs":
    """The rows saved in ``path`` (`artifacts.ArtifactError` naming the field if malformed)."""
    obj = artifacts.read_json(path, "the conditional KLs")
    head = codec.decode(cls, obj, path, path=Path(path), rows={})  # (the rows need its split)
    return dataclasses.replace(head, rows={
        name: codec.decode(ConditionalKL, row, path, f"rows.{name}", heldout=head.heldout_mask())
        for name, row in artifacts.field(obj, "rows", path, dict).items()})

  def reusable(self, prompt_ids: tuple[str, ...], reference_identity: str,
               proposal_identity: str, rows: Mapping[str, str]) -> dict[str, ConditionalKL]:
    """The saved rows still valid for a job with these prompts, target and proposal: those whose
    checkpoint has the identity it was scored with (``rows``: name -> checkpoint, the ones
    asked for; a saved row not asked for is kept while its checkpoint is unchanged)."""
    if (prompt_ids, reference_identity, proposal_identity) != (
        self.prompt_ids, self.reference_identity, self.proposal_identity):
      return {}
    out = {}
    for name, row in self.rows.items():
      path = rows.get(name, row.model_path)
      if path == row.model_path and Path(path).is_dir() and model_identity(path) == row.model_identity:
        out[name] = row
    return out
