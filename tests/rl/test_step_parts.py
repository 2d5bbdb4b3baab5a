"""A Stage 3 step made of injected parts (issue 28, item 3).

`Trainer` takes its parts (`StepParts`), built by `disa_jax.rl.build`; each stage of a step returns
a new frozen batch type, so a stage handed the wrong stage's batch fails at the type; the anchor
is validated in one place (`build.validate_anchor`); seeds come from `disa_jax.rl.seeds`.
"""
import dataclasses
import inspect

import jax
import numpy as np
import pytest

from disa_jax import parallel, testing
from disa_jax.rl import build, objectives, seeds
from disa_jax.rl.inputs import StepModels
from disa_jax.rl.scorer import BatchScorer
from disa_jax.rl.update import PolicyUpdater
from disa_jax.rl.async_rollout import save_batches
from disa_jax.rl.batch import RolloutBatch, ScoredBatch, SignalBatch
from disa_jax.rl.collect import RolloutCollector
from disa_jax.rl.objective_step import ObjectiveStep
from disa_jax.rl.trainer import StepParts, Trainer
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
  with pytest.raises(TypeError, match="Trainer parts must be a StepParts, got dict"):
    Trainer(tt._cfg(), "/nonexistent", {})  # pylint: disable=protected-access


def test_each_stage_takes_only_the_previous_stages_batch(tmp_path):
  trainer, _ = tt._trainer(tt._cfg(), tmp_path)  # pylint: disable=protected-access
  assert isinstance(trainer.parts, StepParts)
  rollout = _rollout_batch()
  scored = ScoredBatch(rollout=rollout, ref_logp=np.zeros((4, 3), np.float32),
                       log_z=np.zeros(4, np.float32))
  # The scorer refuses an already scored (or any non-rollout) batch before any pass runs.
  with pytest.raises(TypeError, match="BatchScorer.score takes a RolloutBatch, got ScoredBatch"):
    trainer.scorer.score(scored, trainer.state.params)
  # The objective refuses an unscored batch; the update's inputs exist only on a SignalBatch.
  with pytest.raises(TypeError, match="ObjectiveStep.apply takes a ScoredBatch, got RolloutBatch"):
    trainer.parts.objective.apply(rollout)
  assert not hasattr(rollout, "train_sequences") and not hasattr(scored, "train_sequences")
  with pytest.raises(TypeError, match="SignalBatch.scored takes a ScoredBatch, got RolloutBatch"):
    SignalBatch(scored=rollout, signal=np.zeros(4, np.float32))
  # Nothing is filled in place: every batch is frozen.
  for batch, field in ((rollout, "reward"), (scored, "old_logp")):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(batch, field, None)
  signalled = trainer.parts.objective.apply(scored)
  assert isinstance(signalled, SignalBatch) and signalled.signal.shape == (4,)
  seqs = signalled.train_sequences()
  np.testing.assert_array_equal(seqs.log_z, scored.log_z)
  # In-flight batches are saved unscored only.
  with pytest.raises(TypeError, match=r"save_batches \(batch of step 3\) takes a RolloutBatch"):
    save_batches(tmp_path / "f.npz", {3: scored})
  trainer.close()


def test_signal_batch_names_a_wrong_signal_shape():
  scored = ScoredBatch(rollout=_rollout_batch())
  with pytest.raises(ValueError, match=r"SignalBatch.signal has shape \(2, 2\), expected \(4,\)"):
    SignalBatch(scored=scored, signal=np.zeros((2, 2), np.float32))
  with pytest.raises(TypeError, match="ObjectiveStep.objective must be an Objective, got str"):
    ObjectiveStep("disa")


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
    build.validate_anchor(tt._cfg("grpo").objective, object(), hidden_size=32)  # pylint: disable=protected-access
  # The parts take the validated anchor as given: the scorer checks no anchor of its own.
  cfg = tt._cfg()  # pylint: disable=protected-access
  mesh = parallel.make_mesh(devices=jax.devices()[:1])
  policy = testing.make_tiny_model(seed=0, **tt.TINY)
  step_models = StepModels(policy, policy, mesh, pad_to=16)
  updater = PolicyUpdater(cfg, step_models, pad_id=0)
  scorer = BatchScorer(cfg, step_models, updater.graphdef, anchor=None, pad_id=0)
  assert scorer.anchor is None


def test_validate_anchor_prefixes_its_source():
  anchor = tt._anchor(tt.TINY["hidden_size"], beta=15.0)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"^data.anchor_path='/a': .*beta"):
    build.validate_anchor(tt._cfg().objective, anchor, hidden_size=tt.TINY["hidden_size"],  # pylint: disable=protected-access
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
