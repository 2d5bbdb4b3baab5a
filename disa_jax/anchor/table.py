"""A frozen anchor given as a table of log Z values by prompt id (e.g. the exact log Z: the oracle).

`TableAnchor` answers Stage 3's query with a stored value per prompt id instead of a regressor on
prompt embeddings. With the exact log Z(q) (available when the correct set can be enumerated, as in
the main job's sum task) it is the oracle of Prop. 3: DISA with it has the tilted target as its
fixed point, and the gap between DISA with the fitted anchor and with this one is the anchor's
error, bounded by Prop. 4. It carries the same label facts as a fitted anchor (beta, reward
transform, label scale) and is refused by the same checks.

`load_anchor(path)` loads either kind from its directory.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import codec, paths
from disa_jax.anchor.frozen import Anchor, AnchorMeta, EmbeddingSpec
from disa_jax.estimators.reward_transforms import RewardTransform

TABLE_FILE = "log_z_table.json"


class TableAnchor:
  """log Z by prompt id (see the module docstring).

  Args:
    log_z: prompt id -> log Z (finite).
    beta, reward_transform, label_scale: the facts of the values (as a fitted anchor's).
    source: where the values come from (recorded, e.g. 'exact').
  """

  needs_embeddings = False

  def __init__(self, log_z: Mapping[str, float], *, beta: float, reward_transform: RewardTransform,
               label_scale: str, source: str = "exact"):
    bad = {k: v for k, v in log_z.items() if not np.isfinite(v)}
    if bad:
      raise ValueError(f"TableAnchor: non-finite log Z for prompt ids {sorted(bad)[:10]}")
    if not log_z:
      raise ValueError("TableAnchor needs at least one prompt id, got none")
    self.log_z = {str(k): float(v) for k, v in log_z.items()}
    self.source = source
    self.meta = AnchorMeta(embedding=EmbeddingSpec(source="precomputed", dim=1,
                                                   prompt_format="prompt_id"),
                           beta=float(beta), reward_transform=reward_transform,
                           label_scale=label_scale, label_kind=source)

  def query(self, prompt_ids: Sequence[str], embeddings: Any = None) -> np.ndarray:
    """``[P]`` float32 log Z of ``prompt_ids`` (``embeddings`` is not used)."""
    missing = [p for p in prompt_ids if p not in self.log_z]
    if missing:
      raise KeyError(f"TableAnchor has no log Z for prompt id(s) {missing[:10]}")
    return np.asarray([self.log_z[p] for p in prompt_ids], np.float32)

  def check_compatible(self, *, beta: float, reward_transform: RewardTransform, label_scale: str,
                       embedding_dim: int | None = None, reference: str | None = None,
                       rendering: str | None = None) -> None:
    """The fitted anchor's checks of the label facts (a table by prompt id has no embedding,
    reference model or rendering to check)."""
    del embedding_dim, reference, rendering
    Anchor.check_compatible(self, beta=beta, reward_transform=reward_transform,  # type: ignore[arg-type]
                            label_scale=label_scale)

  def save(self, directory: str | os.PathLike) -> paths.AnyPath:
    d = paths.as_path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    data = {"log_z": self.log_z, "source": self.source, "beta": self.meta.beta,
            "reward_transform": codec.encode(self.meta.reward_transform),
            "label_scale": self.meta.label_scale}
    tmp = d / (TABLE_FILE + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    paths.replace(tmp, d / TABLE_FILE)
    return d

  @classmethod
  def load(cls, directory: str | os.PathLike) -> "TableAnchor":
    d = json.loads((paths.as_path(directory) / TABLE_FILE).read_text())
    return cls(d["log_z"], beta=d["beta"], label_scale=d["label_scale"], source=d["source"],
               reward_transform=codec.decode(RewardTransform, d["reward_transform"],
                                              "reward_transform"))


def load_anchor(directory: str | os.PathLike):
  """The anchor saved in ``directory`` (local or a URL): a `TableAnchor` or a fitted `Anchor`."""
  if (paths.as_path(directory) / TABLE_FILE).exists():
    return TableAnchor.load(directory)
  return Anchor.load(directory)
