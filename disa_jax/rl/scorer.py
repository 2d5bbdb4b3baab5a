"""Score: the second part of a Stage 3 step. Adds the log-probs and log Z the objective reads.

`BatchScorer.score(batch, policy_params)` fills a `RolloutBatch` with what its objective declares:

- ``ref_logp``: teacher-forced log pi_ref of every token (``objective.needs_reference``);
- ``old_logp``: log pi_old, the policy before this step's updates (``objective.needs_old_logp``):
  recomputed by the policy, or the raw log-probs the engine recorded while sampling
  (``rollout.old_logp_source='engine'``; replayed rows are always recomputed). With a single
  on-policy update per batch, pi_old is taken from the update's own forward instead
  (``old_in_update``), and nothing is scored here. With stale rollouts
  (``rollout.max_staleness`` > 0) an objective with ``behaviour_as_old_logp`` (TB) reads the
  engine's log-probs of the behaviour policy mu instead (replayed rows recomputed);
- ``log_z``: the frozen anchor's value of each row's prompt (``objective.needs_anchor``), queried on
  the reference model's mean-pooled prompt states, the embedding the anchor was fitted on.

Scoring runs on the update's micro-batch layout (`RolloutConfig.layout`: packed rows of
``rollout.row_len`` tokens, ``rollout.micro_batch_rows`` rows per pass) on the training mesh; every
process feeds its own rows and receives the full result. Log-probs come back per response token
(``[B, W]``).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from disa_jax import models
from disa_jax.data.packing import PackedRows, sequence_lengths
from disa_jax import parallel
from disa_jax.parallel import distributed
from disa_jax.rl import train_step as ts
from disa_jax.rl.batch import RolloutBatch
from disa_jax.rl.config import TrainConfig
from disa_jax.scoring import packed_prompt_embeddings
from disa_jax.scoring.batched import embed_packed, score_packed


class BatchScorer:
  """Fills a `RolloutBatch` with the passes its objective needs (see the module docstring).

  Args:
    cfg: the run's `TrainConfig`.
    policy_graphdef: the policy's graph (its parameters are passed to `score`).
    reference: the frozen pi_ref (None when the objective needs neither it nor an anchor).
    anchor: the frozen `disa_jax.anchor.Anchor` (objectives with ``needs_anchor``).
    mesh: the training mesh.
    pad_id: padding token id.
    pad_to: without packing, rows are padded to a multiple of this.
    old_in_update: pi_old comes from the update's own forward (one on-policy update per batch).
  """

  def __init__(self, cfg: TrainConfig, *, policy_graphdef: nnx.GraphDef,
               reference: models.Transformer | None, anchor: Any, mesh: jax.sharding.Mesh,
               pad_id: int, pad_to: int, old_in_update: bool):
    obj = cfg.objective
    if (obj.needs_reference or obj.needs_anchor) and reference is None:
      raise ValueError(f"objective {obj.name!r} needs the reference model, got reference=None")
    if obj.needs_anchor and anchor is None:
      raise ValueError(f"objective {obj.name!r} needs the frozen anchor, got anchor=None")
    if anchor is not None and not obj.needs_anchor:
      raise ValueError(f"an anchor was given but objective {obj.name!r} does not use one")
    self.cfg, self.objective, self.anchor = cfg, obj, anchor
    self.pad_id, self.pad_to, self.old_in_update = pad_id, pad_to, old_in_update
    self._rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(ts.BATCH_AXES))
    self._shards = parallel.batch_shards(mesh)
    self._score_policy = ts.make_scoring_fn(policy_graphdef)
    self._replay_checked = False
    if reference is not None:
      self.ref_params = nnx.state(reference, nnx.Param)
      self.anchor_dim = reference.config.hidden_size
      ref_graphdef = nnx.graphdef(reference)
      self._score_ref = ts.make_scoring_fn(ref_graphdef)
      self._embed = jax.jit(lambda p, rows, slots: packed_prompt_embeddings(
          nnx.merge(ref_graphdef, p), rows, slots), static_argnums=2)

  def _put(self, rows: PackedRows) -> PackedRows:
    return distributed.shard_global_batch(rows, self._rows)

  def _batched(self, fn, params, batch: RolloutBatch) -> np.ndarray:
    """``[B, W]`` per-response-token log-probs of ``batch`` on packed micro-batches."""
    prompts = batch.prompts
    layout = self.cfg.rollout.layout(sequence_lengths(prompts, batch.response_ids), self.pad_to,
                                     self._shards)
    return batch.response_logp_rows(score_packed(
        lambda rows: fn(params, rows), prompts, batch.response_ids, layout, pad_id=self.pad_id,
        put=self._put, fetch=distributed.replicate_to_hosts))

  def anchor_log_z(self, prompt_ids: list[str], prompt_tokens: list[tuple[int, ...]]) -> np.ndarray:
    """``[P]`` the anchor's log Z of each prompt (from the reference's prompt embeddings, for an
    anchor that regresses on them)."""
    if not self.anchor.needs_embeddings:
      return self.anchor.query(prompt_ids, None)
    layout = self.cfg.rollout.layout([len(p) for p in prompt_tokens], self.pad_to, self._shards)
    emb = embed_packed(lambda rows: self._embed(self.ref_params, rows, layout.slots),
                       prompt_tokens, layout, self.anchor_dim, pad_id=self.pad_id, put=self._put,
                       fetch=distributed.replicate_to_hosts)
    return self.anchor.query(prompt_ids, emb)  # [P]

  def score(self, batch: RolloutBatch, policy_params: nnx.State) -> None:
    """Fills ``batch.ref_logp``, ``old_logp`` and ``log_z`` as the objective needs."""
    obj, rc = self.objective, self.cfg.rollout
    if obj.needs_reference:
      batch.ref_logp = self._batched(self._score_ref, self.ref_params, batch)
      self._check_replay_drift(batch)
    if obj.needs_old_logp and not self.old_in_update:
      if rc.max_staleness and obj.behaviour_as_old_logp:
        behaviour = batch.behaviour_logp()  # [B, W], zeros on replayed rows
        if batch.is_replay.any():
          recomputed = self._batched(self._score_policy, policy_params, batch)
          behaviour[batch.is_replay] = recomputed[batch.is_replay]
        batch.old_logp = behaviour
      elif rc.old_logp_source == "recompute" or batch.is_replay.any():
        # Replayed rows have no rollout-time log-probs of the policy: recompute for all rows.
        batch.old_logp = self._batched(self._score_policy, policy_params, batch)
      else:
        batch.old_logp = batch.response_logp_rows(batch.engine_logp)
    if obj.needs_anchor:
      batch.log_z = np.repeat(self.anchor_log_z(batch.prompt_ids, batch.prompt_tokens),
                              batch.group_size)  # [P] -> [P * G]

  def _check_replay_drift(self, batch: RolloutBatch) -> None:
    """Refuses a Stage 1 file scored under another reference (first replay step only)."""
    rep = batch.is_replay
    if self._replay_checked or not rep.any():
      return
    recomputed = batch.ref_logp.sum(-1)[rep]  # [B, W] -> [R] (zeros beyond each response)
    drift = float(np.median(np.abs(recomputed - batch.stored_ref_logp[rep])))
    limit = self.cfg.replay.max_ref_logp_drift
    if drift > limit:
      raise ValueError(
          f"replay: median |stored log pi_ref - recomputed| = {drift:.4g} nats exceeds "
          f"replay.max_ref_logp_drift={limit}: the Stage 1 file was scored under another "
          "reference model or prompt rendering")
    self._replay_checked = True


def replay_stats(batch: RolloutBatch) -> dict[str, float]:
  """Metrics of the replayed rows (share, prompt coverage, accuracy, log pi_ref drift)."""
  rep = batch.is_replay
  g = batch.group_size
  out = {"replay/fraction": float(rep.mean()),
         "replay/prompt_coverage": float(rep.reshape(-1, g).any(-1).mean())}
  if rep.any():
    out["replay/accuracy"] = float((batch.reward[rep] > 0.5).mean())
    if batch.ref_logp is not None:
      recomputed = batch.ref_logp.sum(-1)[rep]
      out["replay/ref_logp_drift"] = float(np.median(np.abs(recomputed -
                                                            batch.stored_ref_logp[rep])))
  return out
