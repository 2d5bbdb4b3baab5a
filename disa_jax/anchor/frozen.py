"""The frozen anchor g_psi*: what Stage 3 queries for log Z(q), with everything needed to refuse misuse.

An `Anchor` bundles the fitted `AnchorMLP` with the facts its labels depend on: the embedding spec
(which model / pooling produced the inputs, and their width), beta, the reward transform and the label
scale ('sum' of trajectory log-probs, the paper's residual, or 'mean', length-normalised as in FlowRL's
code). Stage 3 calls `check_compatible` once and refuses a mismatch with an error naming the field
and both values, including (when it passes them) the reference model the embeddings came from and
how prompts were rendered ('chat_template' or 'plain'): an anchor's log Z is a function of one
reference model's prompt states and is meaningless on another's. The reference is compared by
content (`EmbeddingSpec.model_sha256`, the `disa_jax.checkpoint.identity.fingerprint` of its
directory), so an anchor copied with its reference to other paths is accepted and another model
under the recorded path is refused. An anchor saved before that field existed is compared by
path, or by content when its recorded directory is still there.

An anchor directory may be a URL (``gs://``, `disa_jax.paths`): the weights are written by orbax
into a local directory that is then uploaded, and fetched into one to load.

Calling the anchor returns log Z under `jax.lax.stop_gradient`: no gradient ever reaches psi (§2.2,
Stage 3).
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from disa_jax import codec, paths
from disa_jax.anchor.mlp import AnchorMLP
from disa_jax.checkpoint.identity import fingerprint
from disa_jax.data.prompting import RENDERINGS
from disa_jax.estimators.dataset import LABEL_SCALES
from disa_jax.estimators.reward_transforms import RewardTransform

META_FILE = "anchor_meta.json"
STATE_DIR = "state"


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec:
  """Where the anchor's input embeddings come from.

  Attributes:
    source: 'precomputed' (any ``[P, D]`` array supplied by the user) or 'model_mean_pool' (masked mean
      of a Flax LM's final hidden state over the prompt tokens).
    dim: embedding width D.
    model_path: the reference model directory for 'model_mean_pool' (where it was).
    model_sha256: that directory's content fingerprint (`disa_jax.checkpoint.identity.fingerprint`),
      what `Anchor.check_compatible` compares the run's reference with; None for anchors saved
      before this field existed (their ``model_path`` is compared instead).
    prompt_format: free-form provenance of the prompt text (e.g. 'stage1_prompt_text', 'raw').
    rendering: how prompts were rendered before tokenisation, one of `RENDERINGS` ('chat_template':
      the tokenizer's chat template; 'plain': the user text), or None when not recorded (anchors
      saved before this field existed load with None).
  """

  source: str = "precomputed"
  dim: int = 0
  model_path: str | None = None
  prompt_format: str = "raw"
  rendering: str | None = None
  model_sha256: str | None = None

  JSON_STRICT = True  # (`codec`: unknown keys are refused)

  def __post_init__(self):
    if self.source not in ("precomputed", "model_mean_pool"):
      raise ValueError(f"EmbeddingSpec.source must be 'precomputed' or 'model_mean_pool', got {self.source!r}")
    if self.dim < 1:
      raise ValueError(f"EmbeddingSpec.dim must be >= 1, got {self.dim!r}")
    if self.rendering is not None and self.rendering not in RENDERINGS:
      raise ValueError(f"EmbeddingSpec.rendering must be one of {RENDERINGS} or None, got {self.rendering!r}")


def _same_path(recorded: str | None, given: str) -> bool:
  """Whether two model directories are the same: equal normalised paths, one real directory, or
  (both there) the same content."""
  if recorded is None:
    return False
  if os.path.normpath(recorded) == os.path.normpath(given):
    return True
  if not (paths.as_path(recorded).exists() and paths.as_path(given).exists()):
    return False
  if not paths.is_remote(recorded) and not paths.is_remote(given) \
      and os.path.samefile(recorded, given):
    return True
  return fingerprint(recorded) == fingerprint(given)


def _check_reference(spec: EmbeddingSpec, reference: str) -> None:
  """Refuses a run's reference model other than the one ``spec``'s embeddings came from: by
  content (`EmbeddingSpec.model_sha256`), or for an anchor saved before that field, `_same_path`."""
  refit = "refit the anchor (Stage 2) on the run's reference model"
  if spec.model_sha256 is not None:
    given = fingerprint(reference)
    if given != spec.model_sha256:
      raise ValueError(f"anchor was fitted on prompt embeddings of reference model "
                       f"{spec.model_path!r} (EmbeddingSpec.model_sha256={spec.model_sha256!r}), "
                       f"but the run's reference {reference!r} holds other content (sha256 "
                       f"{given!r}); {refit}")
  elif not _same_path(spec.model_path, reference):
    raise ValueError(f"anchor was fitted on prompt embeddings of reference model "
                     f"{spec.model_path!r} (EmbeddingSpec.model_path), but the run's reference "
                     f"is {reference!r}; {refit} (this anchor records no content fingerprint of "
                     f"its reference, EmbeddingSpec.model_sha256: it was saved before anchors "
                     f"did)")


@dataclasses.dataclass(frozen=True)
class AnchorMeta:
  """Everything about an anchor except its weights (saved as JSON next to them)."""

  embedding: EmbeddingSpec
  beta: float
  reward_transform: RewardTransform
  label_scale: str
  hidden_sizes: tuple[int, ...] = (64,)
  activation: str = "relu"
  label_kind: str = "log_z_is"  # which Stage 1 label was regressed (e.g. 'log_z_is', 'jensen_corrected')
  fit_summary: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.label_scale not in LABEL_SCALES:
      raise ValueError(f"AnchorMeta.label_scale must be one of {LABEL_SCALES}, got {self.label_scale!r}")
    if not self.beta > 0:
      raise ValueError(f"AnchorMeta.beta must be > 0, got {self.beta!r}")

  JSON_STRICT = True  # (`codec`: unknown keys are refused)


class Anchor:
  """A frozen g_psi*: ``anchor(embeddings [P, D]) -> [P]`` log Z under stop_gradient."""

  needs_embeddings = True

  def __init__(self, mlp: AnchorMLP, meta: AnchorMeta):
    self.meta = meta
    self._graphdef, self._state = nnx.split(mlp)
    self._apply = jax.jit(lambda state, x: nnx.merge(self._graphdef, state)(x))

  @property
  def state(self) -> nnx.State:
    return self._state

  def __call__(self, embeddings: jax.Array) -> jax.Array:
    """log Z predictions with no gradient path to psi.

    Args:
      embeddings: ``[P, D]`` prompt embeddings made as ``meta.embedding`` describes.

    Returns:
      ``[P]`` float32.
    """
    # The anchor is tiny and lives on one device; embeddings may arrive sharded over a mesh, so a
    # multi-device array is gathered to the host first ([P, D] is small) rather than mixing device
    # sets in one jit. Tracers (the anchor called under jit / grad) pass through unchanged.
    if isinstance(embeddings, jax.Array) and not isinstance(embeddings, jax.core.Tracer) \
        and len(embeddings.sharding.device_set) > 1:
      embeddings = np.asarray(embeddings)
    x = jnp.asarray(embeddings, jnp.float32)
    if x.ndim != 2 or x.shape[1] != self.meta.embedding.dim:
      raise ValueError(f"anchor expects embeddings of shape [P, {self.meta.embedding.dim}], got {x.shape}")
    return jax.lax.stop_gradient(self._apply(jax.lax.stop_gradient(self._state), x))

  def query(self, prompt_ids, embeddings: jax.Array) -> np.ndarray:
    """``[P]`` float32 log Z of the prompts with these ``[P, D]`` embeddings (Stage 3's query; the
    ids are for anchors keyed by prompt, `disa_jax.anchor.table.TableAnchor`)."""
    del prompt_ids
    return np.asarray(self(embeddings), np.float32)

  def check_compatible(self, *, beta: float, reward_transform: RewardTransform, label_scale: str,
                       embedding_dim: int | None = None, reference: str | None = None,
                       rendering: str | None = None) -> None:
    """Raises ValueError naming the first field on which this anchor and a Stage 3 run disagree.

    Args:
      beta, reward_transform, label_scale: the run's; must equal the anchor's.
      embedding_dim: the run's embedding width D (checked when given).
      reference: the run's reference model directory (checked when given): its content must be
        the recorded `EmbeddingSpec.model_sha256` (`_check_reference`).
      rendering: how the run renders prompts, one of `RENDERINGS` (checked when given): must be the
        recorded `EmbeddingSpec.rendering`.
    """
    m = self.meta
    if abs(float(beta) - m.beta) > 1e-9 * max(1.0, abs(m.beta)):
      raise ValueError(f"anchor was fitted with beta={m.beta}, but the run uses beta={beta}")
    if label_scale != m.label_scale:
      raise ValueError(f"anchor labels use label_scale={m.label_scale!r} (log-prob "
                       f"{'sums' if m.label_scale == 'sum' else 'length-normalised means'}), but the run uses "
                       f"label_scale={label_scale!r}; the residual would mix scales")
    reward_transform.check_matches(m.reward_transform, what="anchor")
    if embedding_dim is not None and embedding_dim != m.embedding.dim:
      raise ValueError(f"anchor expects embedding dim {m.embedding.dim}, the run provides {embedding_dim}")
    if reference is not None:
      _check_reference(m.embedding, reference)
    if rendering is not None:
      if rendering not in RENDERINGS:
        raise ValueError(f"rendering must be one of {RENDERINGS}, got {rendering!r}")
      if m.embedding.rendering != rendering:
        raise ValueError(f"anchor was fitted on prompts rendered as {m.embedding.rendering!r} "
                         f"(EmbeddingSpec.rendering; None: not recorded by the Stage 2 that saved it), but "
                         f"the run renders them as {rendering!r}; refit the anchor with that rendering")

  # --------------------------------------------------------------------------------------------
  # persistence
  # --------------------------------------------------------------------------------------------

  def save(self, directory: str | os.PathLike) -> paths.AnyPath:
    """Writes the orbax-saved weights, then ``anchor_meta.json``, under ``directory`` (created;
    local or a URL).

    The metadata file is written last (atomically; on an object store a copy of a complete
    temporary) and marks a complete anchor: weights without it are what a save killed midway left
    behind, and are replaced (with a warning).

    Raises:
      FileExistsError: ``directory`` already holds a complete anchor.
    """
    d = paths.as_path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / META_FILE).exists():
      raise FileExistsError(f"{d} already holds an anchor ({META_FILE}); choose a new directory")
    leftovers = sorted(p for p in d.iterdir() if p.name == STATE_DIR or p.name.startswith(
        STATE_DIR + ".orbax-checkpoint-tmp") or p.name == META_FILE + ".tmp")
    if leftovers:
      warnings.warn(f"{d}: removing {[p.name for p in leftovers]} left by an anchor save that did not "
                    f"finish (no {META_FILE})")
      for p in leftovers:
        paths.remove(p)
    with paths.staged_dir(d) as local:  # (d itself when local)
      with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(local / STATE_DIR, nnx.to_pure_dict(self._state))
    tmp = d / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(codec.encode(self.meta), indent=1, allow_nan=True))
    paths.replace(tmp, d / META_FILE)
    return d

  @classmethod
  def load(cls, directory: str | os.PathLike) -> "Anchor":
    """Restores an anchor written by `save` (local or a URL)."""
    d = paths.as_path(directory).resolve()
    if not (d / META_FILE).exists():
      raise FileNotFoundError(f"no {META_FILE} in {d}: not an anchor directory")
    meta = codec.load(AnchorMeta, d / META_FILE, "the anchor")
    mlp = AnchorMLP(meta.embedding.dim, meta.hidden_sizes, meta.activation, rngs=nnx.Rngs(0))
    state = nnx.state(mlp)
    target = nnx.to_pure_dict(state)
    with paths.local_copy(d / STATE_DIR) as weights, ocp.StandardCheckpointer() as ckptr:
      restored = ckptr.restore(weights, target)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(mlp, state)
    return cls(mlp, meta)
