"""A Stage 3 step made of injected parts (issue 28, item 3; issue 46).

`Trainer` takes its parts (`StepParts`), built by `disa_jax.rl.build`; each stage of a step returns
a new frozen batch type (`RolloutBatch` -> `ScoredBatch` -> `TrainBatch`); the anchor is validated
in one place (`build.validate_anchor`); seeds come from `disa_jax.rl.seeds`.
"""
import dataclasses
import inspect

import jax
import numpy as np
import pytest

from disa_jax import parallel, testing
from disa_jax.data.packing import PackingLayout
from disa_jax.rl import build, objectives, seeds
from disa_jax.rl.async_rollout import RolloutPipeline
from disa_jax.rl.inputs import EngineLink, StepModels
from disa_jax.rl.scorer import BatchScorer
from disa_jax.rl.update import PolicyUpdater
from disa_jax.rl.batch import RolloutBatch, ScoredBatch, pack_rollout
from disa_jax.rl.collect import RolloutCollector
from disa_jax.rl.trainer import StepParts, Trainer
from disa_jax.scoring.batched import score_packed
from tests.rl import test_trainer as tt


def _rollout_batch():
  """A graded 2-prompt x 2-row batch (W = 3), as the collector returns it."""
  return RolloutBatch(
      prompt_ids=["a", "b"], prompt_tokens=[(3, 4), (5,)], group_size=2, response_width=3,
      response_ids=[np.array(x, np.int32) for x in ([7, 2], [8], [9, 9, 2], [6])],
      reward=np.array([1, 0, 1, 1], np.float32), grade_error=np.zeros(4, bool),
      is_replay=np.zeros(4, bool),
      sampled_logp=[np.array(x, np.float32) for x in ([-.5, -.1], [-2.], [-.3, -.2, -.1], [-1.])],
      engine_logp=[None] * 4, finish_reason=["stop", "length", "stop", "stop"],
      stored_ref_logp=np.full(4, np.nan))


def test_trainer_takes_its_parts_in_at_most_8_arguments():
  params = inspect.signature(Trainer.__init__).parameters
  assert len(params) <= 8, list(params)
  assert "parts" in params and "policy" not in params and "engine" not in params


def test_each_stage_returns_a_new_frozen_batch(tmp_path):
  """rollout -> score (log-probs, log Z and the objective's signal) -> update's micro-batches."""
  trainer, _ = tt._trainer(tt._cfg(), tmp_path)  # pylint: disable=protected-access
  parts = trainer.parts
  assert isinstance(parts, StepParts)
  rollout = parts.collector.collect(0)
  packed = parts.updater.pack(0, rollout)
  scored = parts.scorer.score(packed, parts.updater.state.params)
  assert isinstance(scored, ScoredBatch) and scored.rollout is rollout and scored.packed is packed
  grouped = rollout.grouped_reward
  np.testing.assert_array_equal(scored.signal, trainer.cfg.objective.batch_signal(
      grouped, rollout.is_replay.reshape(grouped.shape)).reshape(-1))  # [P, G] -> [B]
  np.testing.assert_array_equal(scored.log_z, np.repeat(parts.scorer.anchor_log_z(
      rollout.prompt_ids, rollout.prompt_tokens), rollout.group_size))  # DISA: the anchor's
  assert scored.ref_logp.shape == (rollout.num_rows, rollout.response_width)
  # The update's inputs exist only on a ScoredBatch; nothing is filled in place.
  assert not hasattr(rollout, "micro_batches")
  for batch, field in ((rollout, "reward"), (packed, "minibatches"), (scored, "old_slots")):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(batch, field, None)
  trainer.close()


@pytest.mark.slow
def test_shared_prompts_scored_on_the_batch_in_rollout_order(tmp_path):
  """With shared prompts and 2 shuffled mini-batches, pi_ref and pi_old are each sequence's
  log-probs on the whole batch packed in rollout order (one unit per prompt's group), bit for bit:
  what the scorer read before the one packing (cf9f315: `score_packed` on the batch). On the
  mini-batches' own units (another subset of each group, in another order) they differ in the
  last bits (XLA:CPU), which moved the runs' losses in the 7th digit."""
  cfg = tt._cfg()  # pylint: disable=protected-access
  cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, row_len=32,
                                                             share_prompts=True))
  trainer, _ = tt._trainer(cfg, tmp_path)  # pylint: disable=protected-access
  parts = trainer.parts
  rollout = parts.collector.collect(0)
  packed = parts.updater.pack(0, rollout)
  assert len(packed.minibatches) == 2 and packed.share_prompts
  params = parts.updater.state.params
  scored = parts.scorer.score(packed, params)
  for logp, fn, p in ((scored.ref_logp, parts.scorer._score_ref, parts.scorer.ref_params),
                      (scored.old_logp, parts.scorer._score_policy, params)):
    layout = cfg.rollout.layout([], pad_to=16)
    want = score_packed(lambda rows: fn(p, rows), rollout.prompts, rollout.response_ids, layout,
                        pad_id=0)
    for i, w in enumerate(want):
      np.testing.assert_array_equal(logp[i, :len(w)], w, err_msg=f"sequence {i}")
      assert not logp[i, len(w):].any()
  trainer.close()


def test_scored_batch_packs_its_sequences_into_micro_batches():
  """Each slot carries its sequence's log-probs (None as zeros), signal, log Z, the engine's
  log-probs and the on-policy flag; empty slots carry zeros."""
  rollout = _rollout_batch()
  old = np.arange(12, dtype=np.float32).reshape(4, 3) * -0.1  # [B, W]
  packed = pack_rollout(rollout, PackingLayout(row_len=8, rows=2, seqs_per_row=4),
                        [np.arange(4)], pad_id=0)
  scored = ScoredBatch.from_rows(packed, signal=np.array([.5, -.5, 0., 0.], np.float32),
                                 old_logp=old, log_z=np.array([1., 2., 3., 4.], np.float32))
  lengths = np.asarray([len(r) for r in rollout.response_ids])
  np.testing.assert_array_equal(  # the slots read back per sequence, zeros beyond each response
      scored.old_logp, np.where(np.arange(3) < lengths[:, None], old, 0.0))
  micro = scored.train_batches(0)
  slots = [(mb, s) for mb in micro for s in range(mb.num_slots) if mb.response_mask[s].any()]
  assert len(slots) == 4
  by_log_z = {float(mb.log_z[s]): (mb, s) for mb, s in slots}
  assert sorted(by_log_z) == [1., 2., 3., 4.]
  for i, z in enumerate((1., 2., 3., 4.)):
    mb, s = by_log_z[z]
    n = len(rollout.response_ids[i])
    np.testing.assert_array_equal(mb.response_mask[s], np.arange(3) < n)
    np.testing.assert_array_equal(mb.old_logp[s], np.where(np.arange(3) < n, old[i], 0.0))
    np.testing.assert_array_equal(mb.ref_logp[s], 0.0)  # not read by the objective: zeros
    np.testing.assert_array_equal(mb.behaviour_logp[s][:n], rollout.sampled_logp[i])
    assert mb.signal[s] == scored.signal[i] and mb.on_policy[s] == 1.0
  for mb in micro:
    empty = ~mb.response_mask.any(-1)
    assert not (mb.log_z[empty].any() or mb.signal[empty].any() or mb.on_policy[empty].any())


def test_scored_batch_names_a_wrong_signal_shape():
  with pytest.raises(ValueError, match=r"ScoredBatch.signal has shape \(2, 2\), expected \(4,\)"):
    rollout = _rollout_batch()
    ScoredBatch(pack_rollout(rollout, PackingLayout(row_len=8, rows=2), [np.arange(4)], pad_id=0),
                signal=np.zeros((2, 2), np.float32))


def test_the_pipeline_drives_the_engine_the_updater_pushes_to(tmp_path):
  trainer, _ = tt._trainer(tt._cfg(), tmp_path)  # pylint: disable=protected-access
  pipeline = RolloutPipeline(trainer.parts.collector, object(), 1)
  try:
    with pytest.raises(ValueError, match="rollout pipeline drives another engine"):
      dataclasses.replace(trainer.parts, pipeline=pipeline)
  finally:
    pipeline.close()
    trainer.close()


def test_the_anchor_is_checked_once_in_one_place(tmp_path, monkeypatch):
  calls = []
  check = objectives.Disa.check_anchor

  def counting(self, anchor, **kwargs):
    calls.append(kwargs)
    return check(self, anchor, **kwargs)

  monkeypatch.setattr(objectives.Disa, "check_anchor", counting)
  trainer, _ = tt._trainer(tt._cfg(), tmp_path / "ok")  # pylint: disable=protected-access
  trainer.close()
  assert calls == [{"embedding_dim": tt.TINY["hidden_size"]}]
  # A bad anchor: refused once, by validate_anchor, naming the field.
  calls.clear()
  with pytest.raises(ValueError, match="beta") as bad:
    tt._trainer(tt._cfg(), tmp_path / "bad", anchor=tt._anchor(tt.TINY["hidden_size"], beta=15.0))  # pylint: disable=protected-access
  frames = [e.name for e in bad.traceback]
  assert len(calls) == 1 and "validate_anchor" in frames
  assert "__init__" not in frames  # no part's constructor checks it
  with pytest.raises(ValueError, match="objective 'disa' needs the frozen anchor, got anchor=None"
                     ) as missing:
    tt._trainer(tt._cfg(), tmp_path / "none", anchor=None)  # pylint: disable=protected-access
  assert missing.traceback[-1].name == "validate_anchor"
  with pytest.raises(ValueError, match="an anchor was given but objective 'grpo' does not use one"):
    build.validate_anchor(tt._cfg("grpo"), object(), hidden_size=32)  # pylint: disable=protected-access
  # The parts take the validated anchor as given: the scorer checks no anchor of its own.
  cfg = tt._cfg()  # pylint: disable=protected-access
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  policy = testing.make_tiny_model(seed=0, **tt.TINY)
  step_models = StepModels(policy, policy, mesh, pad_to=16)
  updater = PolicyUpdater(cfg, step_models, pad_id=0, link=EngineLink(None))
  scorer = BatchScorer(cfg, step_models, updater.graphdef, anchor=None, pad_id=0)
  assert scorer.anchor is None


def test_validate_anchor_prefixes_its_source():
  anchor = tt._anchor(tt.TINY["hidden_size"], beta=15.0)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"^data.anchor_path='/a': .*beta"):
    build.validate_anchor(tt._cfg(), anchor, hidden_size=tt.TINY["hidden_size"],  # pylint: disable=protected-access
                          source="data.anchor_path='/a'")


def test_seeds_are_the_runs_derivations():
  assert seeds.rollout_seed(3, 7) == seeds.derive_seed(3, "rollout", 7)
  assert seeds.replay_seed(3, 7) == seeds.derive_seed(3, "replay", 7)
  assert seeds.validation_seed(3, 7) == seeds.derive_seed(3, "validation", 7)
  assert seeds.objective_seed(3, "head") == seeds.derive_seed(3, "head")
  assert 0 <= seeds.derive_seed("x", 1) < 2 ** 31
  np.testing.assert_array_equal(seeds.minibatch_rng(3, 7).permutation(9),
                                np.random.default_rng([3, 7, 17]).permutation(9))
  np.testing.assert_array_equal(seeds.epoch_rng(3, 2).permutation(9),
                                np.random.default_rng([3, 2]).permutation(9))


def _old_rule(obj, rc) -> str:
  """The resolution the scorer and `TrainConfig` wrote out before `Objective.needs` (reference)."""
  if not obj.needs_old_logp:
    return ""
  stale_behaviour = bool(rc.max_staleness and obj.behaviour_as_old_logp)
  if (rc.num_minibatches == 1 and rc.old_logp_source == "recompute"
      and not obj.needs_batch_log_z and not stale_behaviour):
    return "update"
  return "behaviour" if stale_behaviour else rc.old_logp_source


@pytest.mark.parametrize("method,extra", [("disa", {}), ("flowrl", {}), ("grpo", {}),
                                          ("grpo", {"is_correction": "tis"}), ("gspo", {}),
                                          ("vargrad", {"beta": 2.0, "scale": "mean"})])
def test_needs_resolve_once_what_the_parts_read(method, extra):
  """`Objective.needs` is the one answer to 'what does this step score': every mini-batch count,
  staleness and pi_old source gives the pre-`Needs` rule's source, and the flags follow the
  objective's declarations."""
  base = tt._cfg(method if method != "vargrad" else "disa")  # pylint: disable=protected-access
  obj = (objectives.REGISTRY[method](**extra) if method == "vargrad" else
         dataclasses.replace(base.objective, **extra))
  seen = set()
  for nm in (1, 2):
    for k in (0, 2):
      for src in ("recompute", "engine"):
        if k and src == "engine":
          continue  # refused by RolloutConfig
        rc = dataclasses.replace(base.rollout, num_minibatches=nm, max_staleness=k,
                                 old_logp_source=src)
        needs = obj.needs(rc)
        assert needs.old_logp == _old_rule(obj, rc), (nm, k, src, needs)
        assert needs.old_logp_on_host == (needs.old_logp not in ("", "update"))
        assert (needs.reference, needs.anchor, needs.batch_log_z, needs.behaviour_logp) == (
            obj.needs_reference, obj.needs_anchor, obj.needs_batch_log_z,
            obj.needs_behaviour_logp)
        assert needs.reference_model == (obj.needs_reference or obj.needs_anchor)
        seen.add(needs.old_logp)
  assert seen <= set(objectives.base.OLD_LOGP_FROM)
  if method == "disa":  # TB: each source is reachable
    assert seen == {"update", "recompute", "engine", "behaviour"}
  if method == "vargrad":  # the batch log Z reads pi_old on the host, never in the update
    assert "update" not in seen
  with pytest.raises(ValueError, match="Needs.old_logp must be one of"):
    objectives.Needs(old_logp="cache")


def test_build_trainer_and_the_parts_take_at_most_8_arguments():
  for fn in (build.build_trainer, build.build_parts, RolloutCollector.__init__,
             PolicyUpdater.__init__, BatchScorer.__init__, Trainer.__init__):
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    assert len(params) <= 8, (fn.__qualname__, params)
