"""Score: the second part of a Stage 3 step. Adds what the objective reads, and its signal.

`BatchScorer.score(packed, policy_params)` takes the step's packed training layout (the collector's
`RolloutBatch` packed once, `disa_jax.rl.batch.PackedRollout`) and returns a new `ScoredBatch` with
what its objective reads under the run's rollout settings (`Objective.needs`, resolved once into a
`Needs`), written into the slots of the layout's micro-batches:

- ``ref_slots``: teacher-forced log pi_ref of every response token (``needs.reference``);
- ``old_slots``: log pi_old, the policy before this step's updates (``needs.old_logp``):
  recomputed by the policy, or the raw log-probs the engine recorded while sampling
  (``rollout.old_logp_source='engine'``; replayed rows are always recomputed). With a single
  on-policy update per batch, pi_old is taken from the update's own forward instead
  (``needs.old_logp == "update"``), and nothing is scored here. With stale rollouts
  (``rollout.max_staleness`` > 0) an objective with ``behaviour_as_old_logp`` (TB) reads the
  engine's log-probs of the behaviour policy mu instead (replayed rows recomputed);
- ``log_z``: the frozen anchor's value of each row's prompt (``needs.anchor``), queried on
  the reference model's mean-pooled prompt states, the embedding the anchor was fitted on;
- ``signal``: the objective's per-row scalar (`Objective.batch_signal`: r~ for TB, the group
  advantage for GRPO/GSPO), and for an objective that estimates log Z from the batch's own
  samples (``needs.batch_log_z``: VarGrad) that estimate as ``log_z``, taken after the signal.

Scoring runs on the update's layout (packed rows of ``rollout.row_len`` tokens,
``rollout.micro_batch_rows`` rows per pass), the whole batch in rollout order
(`disa_jax.rl.batch.PackedRollout.scoring_micro`: a sequence's log-probs depend in their last bits
on its neighbours in a row), on the training mesh; every process feeds its own rows and receives
the full result. Log-probs come back per slot and response token of the update's micro-batches
(``[S, W]`` each, through `PackedRollout.scoring_index`), where the update reads them: nothing is
unpacked, nor packed again per mini-batch.

The scorer is built from the run's config and its `StepModels`; the anchor it is given was
validated once, by `disa_jax.rl.build.validate_anchor`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from disa_jax import parallel
from disa_jax.data.packing import PackedRows
from disa_jax.parallel import distributed
from disa_jax.rl.batch import BATCH_AXES, PackedRollout, ScoredBatch
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.inputs import StepModels
from disa_jax.scoring import packed_prompt_embeddings
from disa_jax.scoring.batched import embed_packed, make_scoring_fn


class BatchScorer:
  """Scores a `RolloutBatch` with the passes its objective needs, and adds the objective's signal
  (see the module docstring).

  Args:
    cfg: the run's config: its objective (what it reads decides the passes; its signal and batch
      log Z), ``rollout`` (micro-batch layout, ``old_logp_source``, ``max_staleness``) and
      ``replay.max_ref_logp_drift`` (the largest median |stored - recomputed| log pi_ref of the
      replayed rows); pi_old comes from the update's own forward when ``cfg.old_logp_in_update``.
    step_models: the frozen pi_ref (kept when the objective needs it or an anchor), the training
      mesh and ``pad_to`` (without packing, rows are padded to a multiple of it).
    policy_graphdef: the policy's graph (its parameters are passed to `score`).
    anchor: the frozen `disa_jax.anchor.Anchor`, already validated (objectives whose ``needs``
      has ``anchor``; None otherwise).
    pad_id: padding token id.
  """

  def __init__(self, cfg: TrainConfig, step_models: StepModels, policy_graphdef: nnx.GraphDef,
               anchor: Any, pad_id: int):
    objective, mesh, self.needs = cfg.objective, step_models.mesh, cfg.needs
    reference = step_models.reference if self.needs.reference_model else None
    if self.needs.reference_model and reference is None:
      raise ValueError(f"objective {objective.name!r} needs the reference model, got "
                       "reference=None")
    self.objective, self.rollout, self.anchor = objective, cfg.rollout, anchor
    self.max_ref_logp_drift = cfg.replay.max_ref_logp_drift
    self.pad_id, self.pad_to = pad_id, step_models.pad_to
    self._rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))
    self._shards = parallel.batch_shards(mesh)
    self._score_policy = make_scoring_fn(policy_graphdef)
    self._replay_checked = False
    if reference is not None:
      self.ref_params = nnx.state(reference, nnx.Param)
      self.anchor_dim = reference.config.hidden_size
      ref_graphdef = nnx.graphdef(reference)
      self._score_ref = make_scoring_fn(ref_graphdef)
      self._embed = jax.jit(lambda p, rows, slots: packed_prompt_embeddings(
          nnx.merge(ref_graphdef, p), rows, slots), static_argnums=2)

  def _put(self, rows: PackedRows | list[PackedRows]) -> PackedRows | list[PackedRows]:
    """Host rows (or a list of them, placed in one batched transfer) as global arrays; on one
    device the host arrays (`distributed.feed`)."""
    return distributed.feed(rows, self._rows)

  def _slots(self, fn, params, packed: PackedRollout) -> list[np.ndarray]:
    """``[S, W]`` per-response-token log-probs of every training micro-batch of ``packed``,
    computed on its scoring micro-batches (`PackedRollout.scoring_micro`) and written into the
    training slots (zeros beyond each response and on empty slots)."""
    # Every pass's rows placed together, every pass dispatched before the first fetch (one host
    # transfer each way).
    rows = self._put([pb.rows for pb in packed.scoring_micro])
    values = distributed.replicate_to_hosts([fn(params, r) for r in rows])
    flat = np.concatenate([np.asarray(v, np.float32).reshape(-1) for v in values])
    return [np.where(mask > 0, flat[index], np.float32(0.0))  # [R, L] per pass -> [S, W]
            for index, mask in packed.scoring_index]

  def anchor_log_z(self, prompt_ids: list[str], prompt_tokens: list[tuple[int, ...]]) -> np.ndarray:
    """``[P]`` the anchor's log Z of each prompt (from the reference's prompt embeddings, for an
    anchor that regresses on them)."""
    if not self.anchor.needs_embeddings:
      return self.anchor.query(prompt_ids, None)
    layout = self.rollout.layout([len(p) for p in prompt_tokens], self.pad_to, self._shards)
    emb = embed_packed(lambda rows: self._embed(self.ref_params, rows, layout.slots),
                       prompt_tokens, layout, self.anchor_dim, pad_id=self.pad_id, put=self._put,
                       fetch=distributed.replicate_to_hosts)
    return self.anchor.query(prompt_ids, emb)  # [P]

  def score(self, packed: PackedRollout, policy_params: nnx.State) -> ScoredBatch:
    """The `ScoredBatch` of the step's packed rollout: ``ref_slots``, ``old_slots`` and
    ``log_z`` as the objective needs (None where it does not), and its ``signal``
    ``[P, G] -> [B]``."""
    needs, batch = self.needs, packed.rollout
    ref_slots = old_slots = log_z = None
    if needs.reference:
      ref_slots = self._slots(self._score_ref, self.ref_params, packed)
      self._check_replay_drift(packed, ref_slots)
    if needs.old_logp_on_host:
      old_slots = self._old_slots(packed, policy_params)
    if needs.anchor:
      log_z = np.repeat(self.anchor_log_z(batch.prompt_ids, batch.prompt_tokens),
                        batch.group_size)  # [P] -> [P * G]
    grouped = batch.grouped_reward
    signal = self.objective.batch_signal(
        grouped, batch.is_replay.reshape(grouped.shape)).reshape(-1)  # [P, G] -> [B]
    scored = ScoredBatch(packed, signal=signal, ref_slots=ref_slots, old_slots=old_slots,
                         log_z=log_z)
    if needs.batch_log_z:  # VarGrad: log Z from this batch's own samples
      scored = dataclasses.replace(scored, log_z=self.objective.batch_log_z(scored))  # [B]
    return scored

  def _old_slots(self, packed: PackedRollout, policy_params: nnx.State) -> list[np.ndarray]:
    """``[S, W]`` log pi_old per micro-batch (or the behaviour's log mu, see the module
    docstring)."""
    batch = packed.rollout
    if self.needs.old_logp == "behaviour":
      behaviour = packed.slot_tokens(batch.behaviour_logp())  # zeros on replayed rows
      if not batch.is_replay.any():
        return behaviour
      recomputed = self._slots(self._score_policy, policy_params, packed)
      replayed = packed.slot_values(batch.is_replay)
      return [np.where(r[:, None] > 0, c, b) for b, c, r in zip(behaviour, recomputed, replayed)]
    if self.needs.old_logp == "recompute" or batch.is_replay.any():
      # Replayed rows have no rollout-time log-probs of the policy: recompute for all rows.
      return self._slots(self._score_policy, policy_params, packed)
    return packed.slot_tokens(batch.engine_logp)

  def _check_replay_drift(self, packed: PackedRollout, ref_slots: list[np.ndarray]) -> None:
    """Refuses a Stage 1 file scored under another reference (first replay step only)."""
    batch = packed.rollout
    rep = batch.is_replay
    if self._replay_checked or not rep.any():
      return
    recomputed = ref_sequence_logp(packed, ref_slots)[rep]
    drift = float(np.median(np.abs(recomputed - batch.stored_ref_logp[rep])))
    limit = self.max_ref_logp_drift
    if drift > limit:
      raise ValueError(
          f"replay: median |stored log pi_ref - recomputed| = {drift:.4g} nats exceeds "
          f"replay.max_ref_logp_drift={limit}: the Stage 1 file was scored under another "
          "reference model or prompt rendering")
    self._replay_checked = True


def ref_sequence_logp(packed: PackedRollout, ref_slots: list[np.ndarray]) -> np.ndarray:
  """``[B]`` log pi_ref of each sequence (its slot's tokens summed; zeros beyond the response)."""
  return packed.sequence_values([r.sum(-1) for r in ref_slots])


def replay_stats(scored: ScoredBatch) -> dict[str, float]:
  """Metrics of the replayed rows (share, prompt coverage, accuracy, log pi_ref drift)."""
  batch = scored.rollout
  rep = batch.is_replay
  g = batch.group_size
  out = {"replay/fraction": float(rep.mean()),
         "replay/prompt_coverage": float(rep.reshape(-1, g).any(-1).mean())}
  if rep.any():
    out["replay/accuracy"] = float((batch.reward[rep] > 0.5).mean())
    if scored.ref_slots is not None:
      recomputed = ref_sequence_logp(scored.packed, scored.ref_slots)[rep]
      out["replay/ref_logp_drift"] = float(np.median(np.abs(recomputed -
                                                            batch.stored_ref_logp[rep])))
  return out
