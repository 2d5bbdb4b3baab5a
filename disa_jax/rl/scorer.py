"""Score: the second part of a Stage 3 step. Adds what the objective reads, and its signal.

`BatchScorer.score(batch, policy_params)` takes the collector's `RolloutBatch` and returns a new
`ScoredBatch` with what its objective reads under the run's rollout settings (`Objective.needs`,
resolved once into a `Needs`):

- ``ref_logp``: teacher-forced log pi_ref of every token (``needs.reference``);
- ``old_logp``: log pi_old, the policy before this step's updates (``needs.old_logp``):
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

Scoring runs on the update's micro-batch layout (`RolloutConfig.layout`: packed rows of
``rollout.row_len`` tokens, ``rollout.micro_batch_rows`` rows per pass) on the training mesh; every
process feeds its own rows and receives the full result. Log-probs come back per response token
(``[B, W]``).

The scorer is built from the run's config and its `StepModels`; the anchor it is given was
validated once, by `disa_jax.rl.build.validate_anchor`.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from disa_jax.data.packing import PackedRows, sequence_lengths
from disa_jax import parallel
from disa_jax.parallel import distributed
from disa_jax.rl import update
from disa_jax.rl.batch import RolloutBatch, ScoredBatch
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.inputs import StepModels
from disa_jax.scoring import packed_prompt_embeddings
from disa_jax.scoring.batched import embed_packed, score_packed


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
    self._rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(update.BATCH_AXES))
    self._shards = parallel.batch_shards(mesh)
    self._score_policy = update.make_scoring_fn(policy_graphdef)
    self._replay_checked = False
    if reference is not None:
      self.ref_params = nnx.state(reference, nnx.Param)
      self.anchor_dim = reference.config.hidden_size
      ref_graphdef = nnx.graphdef(reference)
      self._score_ref = update.make_scoring_fn(ref_graphdef)
      self._embed = jax.jit(lambda p, rows, slots: packed_prompt_embeddings(
          nnx.merge(ref_graphdef, p), rows, slots), static_argnums=2)

  def _put(self, rows: PackedRows) -> PackedRows:
    return distributed.shard_global_batch(rows, self._rows)

  def _batched(self, fn, params, batch: RolloutBatch) -> np.ndarray:
    """``[B, W]`` per-response-token log-probs of ``batch`` on packed micro-batches."""
    prompts = batch.prompts
    layout = self.rollout.layout(sequence_lengths(prompts, batch.response_ids), self.pad_to,
                                     self._shards)
    return batch.response_logp_rows(score_packed(
        lambda rows: fn(params, rows), prompts, batch.response_ids, layout, pad_id=self.pad_id,
        put=self._put, fetch=distributed.replicate_to_hosts))

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

  def score(self, batch: RolloutBatch, policy_params: nnx.State) -> ScoredBatch:
    """The `ScoredBatch` of ``batch``: ``ref_logp``, ``old_logp`` and ``log_z`` as the objective
    needs (None where it does not), and its ``signal`` ``[P, G] -> [B]``."""
    needs = self.needs
    ref_logp = old_logp = log_z = None
    if needs.reference:
      ref_logp = self._batched(self._score_ref, self.ref_params, batch)
      self._check_replay_drift(batch, ref_logp)
    if needs.old_logp_on_host:
      old_logp = self._old_logp(batch, policy_params)
    if needs.anchor:
      log_z = np.repeat(self.anchor_log_z(batch.prompt_ids, batch.prompt_tokens),
                        batch.group_size)  # [P] -> [P * G]
    grouped = batch.grouped_reward
    signal = self.objective.batch_signal(
        grouped, batch.is_replay.reshape(grouped.shape)).reshape(-1)  # [P, G] -> [B]
    scored = ScoredBatch(rollout=batch, signal=signal, ref_logp=ref_logp, old_logp=old_logp,
                         log_z=log_z)
    if needs.batch_log_z:  # VarGrad: log Z from this batch's own samples
      scored = dataclasses.replace(scored, log_z=self.objective.batch_log_z(scored))  # [B]
    return scored

  def _old_logp(self, batch: RolloutBatch, policy_params: nnx.State) -> np.ndarray:
    """``[B, W]`` log pi_old (or the behaviour's log mu, see the module docstring)."""
    if self.needs.old_logp == "behaviour":
      behaviour = batch.behaviour_logp()  # [B, W], zeros on replayed rows
      if batch.is_replay.any():
        recomputed = self._batched(self._score_policy, policy_params, batch)
        behaviour[batch.is_replay] = recomputed[batch.is_replay]
      return behaviour
    if self.needs.old_logp == "recompute" or batch.is_replay.any():
      # Replayed rows have no rollout-time log-probs of the policy: recompute for all rows.
      return self._batched(self._score_policy, policy_params, batch)
    return batch.response_logp_rows(batch.engine_logp)

  def _check_replay_drift(self, batch: RolloutBatch, ref_logp: np.ndarray) -> None:
    """Refuses a Stage 1 file scored under another reference (first replay step only);
    ``ref_logp`` is ``[B, W]``."""
    rep = batch.is_replay
    if self._replay_checked or not rep.any():
      return
    recomputed = ref_logp.sum(-1)[rep]  # [B, W] -> [R] (zeros beyond each response)
    drift = float(np.median(np.abs(recomputed - batch.stored_ref_logp[rep])))
    limit = self.max_ref_logp_drift
    if drift > limit:
      raise ValueError(
          f"replay: median |stored log pi_ref - recomputed| = {drift:.4g} nats exceeds "
          f"replay.max_ref_logp_drift={limit}: the Stage 1 file was scored under another "
          "reference model or prompt rendering")
    self._replay_checked = True


def replay_stats(scored: ScoredBatch) -> dict[str, float]:
  """Metrics of the replayed rows (share, prompt coverage, accuracy, log pi_ref drift)."""
  batch = scored.rollout
  rep = batch.is_replay
  g = batch.group_size
  out = {"replay/fraction": float(rep.mean()),
         "replay/prompt_coverage": float(rep.reshape(-1, g).any(-1).mean())}
  if rep.any():
    out["replay/accuracy"] = float((batch.reward[rep] > 0.5).mean())
    if scored.ref_logp is not None:
      recomputed = scored.ref_logp.sum(-1)[rep]
      out["replay/ref_logp_drift"] = float(np.median(np.abs(recomputed -
                                                            batch.stored_ref_logp[rep])))
  return out
