"""Stage 1 replay in Stage 3: the pool, the config rules, and the rows it puts in the rollout batch."""
import dataclasses

import numpy as np
import pytest

from disa_jax import estimators as E
from disa_jax import testing
from disa_jax.rl import config as rl_config
from disa_jax.rl import seeds
from disa_jax.rl.build import build_trainer
from disa_jax.rl.inputs import AnchorInput, EngineLink, StepModels
from disa_jax.rl.replay import ReplayPool, ReplaySample, replay_count
from disa_jax.rl.scorer import replay_stats
from disa_jax.scoring.batched import SequenceScorer
from tests.rl import test_trainer as T

COVERED = ("p0", "p1", "p2", "p3")  # p4 has no Stage 1 record


def _write_stage1(path, *, shift=0.0, n=3, long_sample=False, neg_inf=False):
  """A Stage 1 jsonl for COVERED: n random responses per prompt scored under the test reference."""
  ref = testing.make_tiny_model(seed=0, **T.TINY)
  scorer = SequenceScorer(ref, pad_id=0, batch_size=16, pad_to=16)
  prompts = {it.prompt_id: it for it in T._prompts()}
  rng = np.random.default_rng(5)
  samples = []
  for pid in COVERED:
    resp = [rng.integers(3, 100, rng.integers(1, 5)).tolist() for _ in range(n)]
    if long_sample and pid == "p0":
      resp[0] = list(range(3, 13))  # 10 tokens > max_response_len = 6
    lp = scorer.sequence_logprobs([list(prompts[pid].token_ids)] * n, resp)
    ss = []
    for j, (r, l) in enumerate(zip(resp, lp)):
      l = -np.inf if neg_inf and pid == "p1" and j == 0 else l + shift
      ss.append({"token_ids": r, "text": "", "logp_ref": float(l), "logp_proposal": -3.0 * len(r),
                 "reward": float(j % 2), "num_tokens": len(r)})
    samples.append(ss)
  recs = E.build_records(list(COVERED), list(COVERED), samples, beta=2.0,
                         reward_transform=E.RewardTransform(kind="raw"))
  E.Stage1Writer(path, fmt="jsonl").write(recs)
  return str(path)


def _replay_cfg(method, fraction=0.5, **kw):
  cfg = T._cfg(method=method, steps=2)
  return dataclasses.replace(cfg, replay=rl_config.ReplayConfig(fraction=fraction, **kw))


class CountingEngine(T.RecordingEngine):
  """Records the n and the prompts of every generate call."""

  def __init__(self, model):
    super().__init__(model)
    self.calls = []

  def generate(self, prompt_token_ids, params):
    self.calls.append((params.n, [tuple(p) for p in prompt_token_ids]))
    return super().generate(prompt_token_ids, params)


def _trainer(cfg, workdir, path):
  policy = testing.make_tiny_model(seed=0, **T.TINY)
  reference = testing.make_tiny_model(seed=0, **T.TINY)
  engine = CountingEngine(testing.make_tiny_model(seed=0, **T.TINY))
  anchor = T._anchor(policy.config.hidden_size) if cfg.objective.needs_anchor else None
  task = T._task(replay_pool=ReplayPool.from_stage1(path, max_response_len=6))
  return build_trainer(cfg, str(workdir), StepModels(policy, reference, T._mesh1(), pad_to=16),
                       task, EngineLink(engine), AnchorInput(anchor)), engine


def test_pool_counts_what_it_leaves_out_and_draws_deterministically(tmp_path):
  path = _write_stage1(tmp_path / "s1.jsonl", n=3, long_sample=True, neg_inf=True)
  pool = ReplayPool.from_stage1(path, max_response_len=6)
  assert pool.skipped == {"logp_ref_not_finite": 1, "longer_than_max_response_len": 1,
                         "not_correct": 0, "duplicate": 0, "beyond_first_samples": 0}
  # correct_only keeps reward > 0.5 only (sample j has reward j % 2); dedupe drops repeats.
  pos = ReplayPool.from_stage1(path, max_response_len=6, correct_only=True, dedupe=True)
  assert all(s.reward == 1.0 for ss in pos.samples.values() for s in ss)
  # 2 wrong per prompt; p0's long one and p1's -inf one (both wrong) are counted under their reason
  assert pos.skipped["not_correct"] == 4 * 2 - 2
  assert sum(len(ss) for ss in pos.samples.values()) == 4  # one correct sample per prompt
  assert len(pool.samples["p0"]) == 2 and len(pool.samples["p1"]) == 2
  assert len(pool.samples["p2"]) == 3
  assert pool.coverage(["p0", "p4"]) == 0.5 and "p4" not in pool
  a = pool.draw(["p2", "p4", "p0"], 2, seed=3)
  b = pool.draw(["p2", "p4", "p0"], 2, seed=3)
  assert [[s.token_ids.tolist() for s in g] for g in a] == [[s.token_ids.tolist() for s in g]
                                                            for g in b]
  assert a[1] == [] and len(a[0]) == 2 and len(a[2]) == 2
  assert a[0][0] is not a[0][1]  # without replacement when the prompt has enough samples
  over = pool.draw(["p0"], 5, seed=0)[0]  # more than p0 has: all of them, then with replacement
  assert len(over) == 5 and {id(s) for s in over} == {id(s) for s in pool.samples["p0"]}
  seeds = {tuple(s.token_ids.tolist()) for g in range(20) for s in pool.draw(["p2"], 1, g)[0]}
  assert len(seeds) > 1
  with pytest.raises(ValueError, match="k must be >= 0"):
    pool.draw(["p0"], -1, 0)
  with pytest.raises(ValueError, match="at least one prompt"):
    ReplayPool({"p0": []})
  assert replay_count(0.25, 8) == 2 and replay_count(0.0, 8) == 0


def test_config_rules():
  from disa_jax.config import from_mapping, to_dict
  base = T._cfg(method="grpo")
  with pytest.raises(ValueError, match="replay.fraction=0.25 is not allowed for objective 'grpo'"):
    dataclasses.replace(base, replay=rl_config.ReplayConfig(fraction=0.25))
  with pytest.raises(ValueError, match=r"replay.fraction must be in \[0, 1\), got 1.0"):
    rl_config.ReplayConfig(fraction=1.0)
  with pytest.raises(ValueError, match="replay.decay_steps"):
    rl_config.ReplayConfig(fraction=0.5, schedule="linear_decay")
  with pytest.raises(ValueError, match="must replay between 1 and 3 samples of a group of 4"):
    dataclasses.replace(T._cfg(), replay=rl_config.ReplayConfig(fraction=0.1))  # G = 4
  c = rl_config.ReplayConfig(fraction=0.5, schedule="linear_decay", decay_steps=4)
  assert [c.fraction_at(s) for s in (0, 2, 4, 9)] == [0.5, 0.25, 0.0, 0.0]
  # The typed config round-trips through the ConfigDict layout.
  cfg = _replay_cfg("flowrl")
  assert from_mapping(rl_config.TrainConfig, to_dict(cfg)) == cfg


@pytest.mark.parametrize("method", ["disa", "flowrl"])
def test_rollout_mixes_stage1_rows_into_each_group(tmp_path, method):
  path = _write_stage1(tmp_path / "s1.jsonl")
  trainer, engine = _trainer(_replay_cfg(method), tmp_path / "run", path)
  pool = trainer.parts.collector.replay
  g, k = 4, 2
  for step in range(2):
    engine.calls.clear()
    items = trainer.parts.collector.stream.batch(step)
    batch = trainer.parts.collector.collect(step)
    updater = trainer.parts.updater
    stats = replay_stats(trainer.parts.scorer.score(updater.pack(step, batch),
                                                    updater.state.params))
    drawn = pool.draw([it.prompt_id for it in items], k,
                      seed=seeds.replay_seed(trainer.cfg.seed, step))
    covered = [it.prompt_id in pool for it in items]
    # One call with G - k for every prompt, then one with k for the uncovered ones.
    assert engine.calls[0][0] == g - k and len(engine.calls[0][1]) == len(items)
    if all(covered):
      assert len(engine.calls) == 1
    else:
      assert engine.calls[1] == (k, [it.token_ids for it, c in zip(items, covered) if not c])
    for i, it in enumerate(items):
      rows = slice(i * g, (i + 1) * g)
      resp = [batch.response_ids[r].tolist() for r in range(rows.start, rows.stop)]
      if covered[i]:
        assert resp[g - k:] == [s.token_ids.tolist() for s in drawn[i]]
    stored = [s.reward for d in drawn for s in d]
    assert stats["replay/accuracy"] == pytest.approx(np.mean(np.asarray(stored) > 0.5))
    assert stats["replay/fraction"] == pytest.approx(k * sum(covered) / (g * len(items)))
    assert stats["replay/ref_logp_drift"] < 1e-4
  trainer.close()


@pytest.mark.slow  # ~11 s: a trainer step compiled
def test_added_rows_keep_the_on_policy_group_whole(tmp_path):
  """mode='add': G on-policy rows per covered prompt plus k replayed ones (R = G + k rows), and
  R on-policy rows for a prompt without Stage 1 samples; the step trains on all of them."""
  path = _write_stage1(tmp_path / "s1.jsonl")
  cfg = dataclasses.replace(_replay_cfg("disa", mode="add"),
                            rollout=dataclasses.replace(T._cfg().rollout, micro_batch_rows=3))
  assert cfg.rows_per_prompt == 4 + 2
  trainer, engine = _trainer(cfg, tmp_path / "run", path)
  items = trainer.parts.collector.stream.batch(0)
  batch = trainer.parts.collector.collect(0)
  covered = [it.prompt_id in trainer.parts.collector.replay for it in items]
  assert batch.num_rows == len(items) * 6
  rep = batch.is_replay.reshape(len(items), 6)
  for i, c in enumerate(covered):
    assert rep[i].tolist() == ([False] * 4 + [True] * 2 if c else [False] * 6)
  assert engine.calls[0][0] == 4  # G on-policy samples for every prompt
  metrics = trainer.step(1)
  assert np.isfinite(metrics["loss"]) and metrics["num_sequences"] == len(items) * 6 / 2  # 2 updates
  trainer.close()


def test_training_with_replay_runs_and_logs(tmp_path):
  path = _write_stage1(tmp_path / "s1.jsonl")
  cfg = dataclasses.replace(_replay_cfg("disa"), validation=rl_config.ValidationConfig())
  trainer, _ = _trainer(cfg, tmp_path / "run", path)
  trainer.run()
  trainer.close()
  rows = T.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
  assert len(rows) == 2
  for r in rows:
    assert np.isfinite(r["loss"]) and 0 < r["replay/fraction"] <= 0.5
    assert 0 <= r["replay/accuracy"] <= 1


def test_stage1_scored_under_another_reference_is_refused(tmp_path):
  path = _write_stage1(tmp_path / "s1.jsonl", shift=1.0)
  trainer, _ = _trainer(_replay_cfg("disa"), tmp_path / "run", path)
  with pytest.raises(ValueError, match="replay.max_ref_logp_drift"):
    trainer.step(0)
  trainer.close()


def test_no_training_prompt_in_the_pool_is_refused(tmp_path):
  pool = ReplayPool({"other": [ReplaySample(np.array([5], np.int32), 1.0, -2.0)]})
  cfg = _replay_cfg("disa")
  policy = testing.make_tiny_model(seed=0, **T.TINY)
  with pytest.raises(ValueError, match="none of the 5 training prompt ids"):
    build_trainer(cfg, str(tmp_path / "run"),
                  StepModels(policy, testing.make_tiny_model(seed=0, **T.TINY), T._mesh1()),
                  T._task(replay_pool=pool),
                  EngineLink(T.RecordingEngine(testing.make_tiny_model(seed=0, **T.TINY))),
                  AnchorInput(T._anchor(policy.config.hidden_size)))
