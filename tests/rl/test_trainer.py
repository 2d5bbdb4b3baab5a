"""End-to-end Stage 3 loop on a tiny model with the in-process JAX sampler."""
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from disa_jax import models, parallel, testing
from disa_jax.anchor import Anchor, AnchorMeta, AnchorMLP, EmbeddingSpec
from disa_jax.config import from_mapping
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.rewards.graded import Graded
from disa_jax.rl.build import build_trainer
from disa_jax.rl.inputs import AnchorInput, EngineLink, RolloutTask, StepModels
from disa_jax.rl.config import TrainConfig, WandbConfig
from disa_jax.rl.metrics import WINDOW_KEYS, MetricsLogger, StepWindow, read_jsonl
from disa_jax.rl.prompts import PromptItem, PromptStream
from disa_jax.rollout.jax_sampler import JaxSampler
from tests.rl.helpers import assert_golden_rows, cpu_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "rl"
TINY = dict(num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
EOS = 2
OBJECTIVES = {"disa": dict(beta=2.0, scale="mean", omega="clipped_ratio"),
              "flowrl": dict(beta=2.0, scale="mean", omega="clipped_ratio"),
              "grpo": dict(eps_high=0.28), "gspo": {}}


def _cfg(method="disa", steps=2, **objective):
  return from_mapping(TrainConfig, dict(
      objective=dict(name=method, **{**OBJECTIVES[method], **objective}),
      optim=dict(lr=1e-3),
      rollout=dict(prompts_per_batch=2, group_size=4, max_prompt_len=8, max_response_len=6,
                   num_minibatches=2, micro_batch_rows=2),
      validation=dict(every=2, n=4, max_tokens=6),
      checkpoint=dict(every=1, keep=2, async_save=True),
      total_steps=steps, progress_bar=False), "train")


def _prompts(n=5):
  rng = np.random.default_rng(0)
  return [PromptItem(f"p{i}", tuple(int(t) for t in rng.integers(3, 100, rng.integers(2, 6))),
                     {"target": int(i % 2)}) for i in range(n)]


def _reward(responses, metas):
  # 1 when the first response token has the prompt's target parity.
  return Graded.ok([float(len(r.token_ids) > 0 and r.token_ids[0] % 2 == m["target"])
                    for r, m in zip(responses, metas)])


def _decode(ids):
  return " ".join(str(int(t)) for t in ids)


def _anchor(dim, label_scale="mean", beta=2.0):
  meta = AnchorMeta(embedding=EmbeddingSpec(source="model_mean_pool", dim=dim), beta=beta,
                    reward_transform=RewardTransform(kind="group_zscore"), label_scale=label_scale)
  return Anchor(AnchorMLP(dim, (8,), "relu", rngs=nnx.Rngs(3)), meta)


class RecordingEngine(JaxSampler):
  """The JAX sampler, recording the keys of every weight sync."""

  def __init__(self, model):
    super().__init__(model, max_batch_size=64, min_prompt_bucket=8, min_new_bucket=8)
    self.synced_keys = []

  def update_weights(self, state_dict):
    self.synced_keys.append(sorted(state_dict))
    super().update_weights(state_dict)

  def load_params(self, source, dtype=None):  # the push in the trainer's process
    self.synced_keys.append(sorted(models.to_hf_state_dict(source)))
    super().load_params(source, dtype)


def _trainer(cfg, workdir, anchor="auto", engine=None):
  policy = testing.make_tiny_model(seed=0, **TINY)
  reference = testing.make_tiny_model(seed=0, **TINY)
  if engine is None:
    engine = RecordingEngine(testing.make_tiny_model(seed=0, **TINY))
  if anchor == "auto":
    anchor = (_anchor(policy.config.hidden_size, beta=cfg.objective.beta)
              if cfg.objective.needs_anchor else None)
  return build_trainer(cfg, str(workdir), StepModels(policy, reference, _mesh1(), pad_to=16),
                       _task(validation_prompts=_prompts(2)), EngineLink(engine),
                       AnchorInput(anchor)), engine


def _mesh1():
  return parallel.make_mesh(devices=jax.devices()[:1])


def _task(prompts=None, **kw) -> RolloutTask:
  """The tiny task's `RolloutTask` (its prompts, reward, decoder, EOS, pad id 0)."""
  return RolloutTask(_prompts() if prompts is None else prompts, _reward, _decode, (EOS,), 0,
                     **kw)


def _strip_time(rows):
  return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
          for r in rows]


@pytest.mark.slow
def test_disa_run_metrics_checkpoints_and_resume(tmp_path, monkeypatch):
  # Uninterrupted 3-step run.
  trainer, engine = _trainer(_cfg(steps=3), tmp_path / "full")
  trainer.run()
  trainer.close()
  full = read_jsonl(str(tmp_path / "full" / "metrics.jsonl"))
  assert [r["step"] for r in full] == [1, 2, 3]
  for key in ("reward", "accuracy", "response_length", "entropy", "tb_residual_mean",
              "tb_residual_std", "log_z_mean", "omega_mean", "omega_clip_frac", "grad_norm",
              "loss", "time/step_s", "tokens_per_s", "eval/mean@4", "eval/pass@4"):
    assert key in full[1], key
  assert all(np.isfinite(r["loss"]) for r in full)
  assert os.listdir(tmp_path / "full" / "tb")
  assert sorted(os.listdir(tmp_path / "full" / "checkpoints")) == ["2", "3"]
  # Every sync sends exactly the policy's HF keys (no log Z head, nothing else).
  expected = sorted(models.expected_hf_keys(trainer.parts.updater.policy.config))
  assert engine.synced_keys and all(k == expected for k in engine.synced_keys)
  # The anchor's log Z enters the residual: its mean is logged.
  assert all(np.isfinite(r["log_z_mean"]) for r in full)
  # The measurement at step 2 (validation.every=2) carries what steps 1-2 did (issue 62 item 6).
  assert not any(k.startswith("window/") for k in full[0]) and full[1]["grad_clipped_share"] == 1
  for key in WINDOW_KEYS:
    assert full[1][f"window/{key}"] == np.mean([full[0][key], full[1][key]]), key

  # Interrupted run: 2 steps, then a fresh trainer on the same workdir resumes for step 3; this
  # run also logs to wandb (offline), which must hold the same rows once each, in one run.
  wandb_offline = pytest.importorskip("tests.rl.wandb_offline")
  wandb_offline.isolate_wandb(tmp_path, monkeypatch)
  cfg2 = dataclasses.replace(_cfg(steps=2), wandb=WandbConfig(enabled=True, mode="offline",
                                                              tags=("test",)))
  t2, _ = _trainer(cfg2, tmp_path / "resumed")
  t2.run()
  t2.close()
  t3, _ = _trainer(dataclasses.replace(cfg2, total_steps=3), tmp_path / "resumed")
  assert t3.start_step == 2
  t3.run()
  t3.close()
  resumed = read_jsonl(str(tmp_path / "resumed" / "metrics.jsonl"))
  assert _strip_time(resumed) == _strip_time(full)
  runs = wandb_offline.offline_runs(tmp_path / "resumed")
  assert len(runs) == 2 and len({r["id"] for r in runs}) == 1
  history = {s: row for r in runs for s, row in r["history"].items()}
  assert sorted(history) == [1, 2, 3] and sum(len(r["history"]) for r in runs) == 3
  assert _strip_time([{"step": s, **row} for s, row in sorted(history.items())]) == _strip_time(
      resumed)
  assert runs[0]["config"]["train"]["objective"]["name"] == "disa"


def test_a_resumed_run_writes_the_window_an_uninterrupted_one_would(tmp_path):
  """`StepWindow.resumed` takes the rows since the last measurement from the metrics file."""
  rows = [{"tb_residual_mean": s - 0.5, "grad_norm": 10.0 * s, "grad_clipped_share": s % 2}
          for s in range(1, 6)]
  logger = MetricsLogger(str(tmp_path), tensorboard=False)
  for s, r in enumerate(rows[:3], 1):
    logger.write(s, r)
  logger.close()
  every_two = lambda s: s % 2 == 0
  window = StepWindow.resumed(str(tmp_path / "metrics.jsonl"), 3, every_two)  # holds step 3
  window.add(rows[3])
  uninterrupted = StepWindow()
  for r in rows[:2]:
    uninterrupted.add(r)
  uninterrupted.close()
  for r in rows[2:4]:
    uninterrupted.add(r)
  want = {"window/tb_residual_mean": 3.0, "window/grad_norm": 35.0,
          "window/grad_clipped_share": 0.5}
  assert window.close() == uninterrupted.close() == want
  assert window.close() == {}  # a new window


@pytest.mark.slow
def test_shared_prompt_run_equals_unshared_run(tmp_path):
  """DISA with rollout.share_prompts: the pi_ref and pi_old passes, the anchor's prompt embeddings
  and the update on shared-prompt rows give the metrics of the unshared run, on fewer tokens."""
  runs = {}
  for share in (False, True):
    cfg = _cfg(steps=2)
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, row_len=32,
                                                               share_prompts=share))
    trainer, _ = _trainer(cfg, tmp_path / str(share))
    trainer.run()
    trainer.close()
    runs[share] = read_jsonl(str(tmp_path / str(share) / "metrics.jsonl"))
  for s, u in zip(runs[True], runs[False]):  # as many rows computed, fewer real tokens in them
    assert s["packing/micro_batches"] == u["packing/micro_batches"]
    assert s["packing/efficiency"] < u["packing/efficiency"]
  for shared, unshared in zip(_strip_time(runs[True]), _strip_time(runs[False])):
    assert shared.keys() == unshared.keys() and np.isfinite(shared["loss"])
    for k, v in unshared.items():
      if not k.startswith("packing/"):
        np.testing.assert_allclose(shared[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


_SHARED_PROMPT_STEPS = """
import dataclasses, json, sys
from tests.rl.test_trainer import _cfg, _strip_time, _trainer
cfg = _cfg(steps=3)
cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, row_len=32,
                                                           share_prompts=True))
trainer, _ = _trainer(cfg, sys.argv[1])
rows = _strip_time(trainer.run())
trainer.close()
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_shared_prompt_steps_equal_the_recorded_ones(tmp_path):
  """DISA with shared prompts and 2 mini-batches (the main job's layout) reproduces the steps of
  main before the one packing per step (cf9f315): every metric, bit for bit on the CPU model that
  recorded it where the fixture names one (`helpers.cpu_model`), to float32 rounding elsewhere
  (`helpers.assert_golden_rows`). The fixture names only the recording's vector extensions: an AMD
  EPYC with the same ones rounded ``grad_norm`` 1.4e-7 apart (relative), so same extensions are
  not the same last bits.

  The fixture (`tests/fixtures/rl/README.md`) was written at cf9f315 by this test's run (3 steps,
  XLA's default optimizations). Scoring the mini-batches' own rows instead of the batch in rollout
  order moved the loss in the 7th digit (4.0293976 vs 4.0293978 at step 0)."""
  golden = json.loads((FIXTURES / "shared_prompt_steps_cf9f315.json").read_text())
  # In a fresh process, as the fixture was written: in a suite worker earlier tests' programs,
  # compiled without XLA's optimizations, were reused and moved 7th digits.
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="0", JAX_ENABLE_COMPILATION_CACHE="false",
             PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                         os.environ.get("PYTHONPATH", "")]))
  proc = subprocess.run([sys.executable, "-c", _SHARED_PROMPT_STEPS, str(tmp_path)], env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  now = json.loads(proc.stdout.strip().splitlines()[-1])
  assert_golden_rows(now, golden["disa"], what="disa", exact=golden.get("cpu") == cpu_model())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["flowrl", "grpo", "gspo"])
def test_baselines_run(tmp_path, method):
  trainer, engine = _trainer(_cfg(method=method, steps=1), tmp_path)
  trainer.run()
  trainer.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert len(rows) == 1 and np.isfinite(rows[0]["loss"])
  if method == "flowrl":
    assert rows[0]["objective_grad_norm"] > 0
    assert all(k == sorted(models.expected_hf_keys(trainer.parts.updater.policy.config))
               for k in engine.synced_keys)
  else:
    assert "clip_frac" in rows[0] and "ratio_mean" in rows[0] or "seq_ratio_mean" in rows[0]


def test_anchor_mismatch_refused(tmp_path):
  policy_dim = TINY["hidden_size"]
  with pytest.raises(ValueError, match="label_scale"):
    _trainer(_cfg(), tmp_path / "a", anchor=_anchor(policy_dim, label_scale="sum"))
  with pytest.raises(ValueError, match="beta"):
    _trainer(_cfg(), tmp_path / "b", anchor=_anchor(policy_dim, beta=15.0))
  with pytest.raises(ValueError, match="needs the frozen anchor"):
    _trainer(_cfg(), tmp_path / "c", anchor=None)


def test_prompt_stream_is_deterministic_and_covers_epochs():
  items = _prompts(5)
  s = PromptStream(items, 2, seed=3, shuffle=True, max_prompt_len=8)
  seen = [it.prompt_id for k in range(5) for it in s.batch(k)]  # 2 epochs
  assert sorted(seen) == sorted([f"p{i}" for i in range(5)] * 2)
  s2 = PromptStream(items, 2, seed=3, shuffle=True, max_prompt_len=8)
  assert [it.prompt_id for it in s2.batch(3)] == [it.prompt_id for it in s.batch(3)]
  with pytest.raises(ValueError, match="max_prompt_len=3"):
    PromptStream(items, 2, seed=3, shuffle=True, max_prompt_len=3)


@pytest.mark.slow
def test_disa_with_fitted_exact_anchor_moves_toward_tilted_target(tmp_path):
  """A short DISA run (Alg. 1 end to end at toy scale).

  Reward: the first response token has the prompt's target parity. With the raw reward and the
  trajectory-sum residual, log Z(q) = log(1 + (e^beta - 1) P_ref(parity | q)) exactly; Stage 2 is
  a real `fit_anchor` on these labels. The tilted target's reward P~(q) = P e^beta / Z is below 1
  (distribution matching, not reward maximisation); the run's reward must rise toward it.
  """
  import jax.numpy as jnp
  from disa_jax import scoring
  from disa_jax.anchor import AnchorFitConfig, fit_anchor
  from disa_jax.data import packing

  beta, steps = 2.0, 240
  # One target parity for every prompt (the tiny model can express it with a vocabulary bias).
  prompts = [dataclasses.replace(p, meta={"target": 0}) for p in _prompts(8)]
  reference = testing.make_tiny_model(seed=0, **TINY)
  (packed,) = packing.pack([list(p.token_ids) for p in prompts], [[] for _ in prompts],
                          packing.PackingLayout(packing=False, rows=len(prompts)), pad_id=0)
  ids, pm = jnp.asarray(packed.rows.input_ids), jnp.asarray(packed.rows.prompt_mask)

  def p_even(model):  # [P] probability that the first response token is even
    logits = model(ids, attention_mask=pm)  # [P, T, V]
    last = pm.sum(-1) - 1
    first_tok = jax.nn.softmax(logits[jnp.arange(len(prompts)), last].astype(jnp.float32), -1)
    return np.asarray(first_tok[:, 0::2].sum(-1))

  p_ref = p_even(reference)
  log_z = np.log1p(np.expm1(beta) * p_ref)
  p_target = p_ref * np.exp(beta) / np.exp(log_z)
  emb = np.asarray(scoring.prompt_embeddings(reference, ids, pm))
  fit = fit_anchor(emb, log_z, embedding=EmbeddingSpec("model_mean_pool", emb.shape[1]),
                   beta=beta, reward_transform=RewardTransform(kind="raw"), label_scale="sum",
                   config=AnchorFitConfig(hidden_sizes=(32,), epochs=400, batch_size=8,
                                          learning_rate=1e-2, val_fraction=0.0))
  anchor_err = float(np.abs(np.asarray(fit.anchor(emb)) - log_z).max())

  cfg = _cfg(steps=steps, beta=beta, scale="sum", reward_transform=dict(kind="raw"))
  cfg = dataclasses.replace(
      cfg, optim=dataclasses.replace(cfg.optim, lr=5e-3),
      rollout=dataclasses.replace(cfg.rollout, prompts_per_batch=4, group_size=8,
                                  num_minibatches=2, micro_batch_rows=8),
      validation=dataclasses.replace(cfg.validation, every=0),
      checkpoint=dataclasses.replace(cfg.checkpoint, every=100))
  trainer = build_trainer(
      cfg, str(tmp_path), StepModels(testing.make_tiny_model(seed=0, **TINY), reference, _mesh1(),
                                     pad_to=16),
      _task(prompts), EngineLink(RecordingEngine(testing.make_tiny_model(seed=0, **TINY))),
      AnchorInput(fit.anchor))
  trainer.run()
  trainer.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  reward = np.array([r["reward"] for r in rows])
  print(f"\nanchor max |g - log Z| = {anchor_err:.3g}; P_ref = {p_ref.mean():.3f}, "
        f"tilted-target reward = {p_target.mean():.3f}")
  for r in rows[::20] + [rows[-1]]:
    print(f"step {r['step']:3d} reward {r['reward']:.3f} tb_res mean {r['tb_residual_mean']:+.3f} "
          f"std {r['tb_residual_std']:.3f} log_z {r['log_z_mean']:.3f} loss {r['loss']:.3f}")
  p_final = float(p_even(trainer.parts.updater.policy).mean())
  print(f"policy P(first token even): start {p_ref.mean():.3f} -> end {p_final:.3f} "
        f"(target {p_target.mean():.3f}); sampled reward first 10 steps {reward[:10].mean():.3f}, "
        f"last 20 steps {reward[-20:].mean():.3f}")
  assert reward[-20:].mean() > reward[:10].mean() + 0.15
  assert p_final > p_ref.mean() + 0.25
  assert p_final < p_target.mean() + 0.08  # distribution matching: no collapse onto the reward


def test_resume_refuses_a_changed_config(tmp_path):
  trainer, _ = _trainer(_cfg(steps=1), tmp_path)
  trainer.save(1)
  trainer.close()
  changed = _cfg(steps=2, beta=3.0)
  with pytest.raises(ValueError, match=r"objective.beta=2.0, this run has 3.0"):
    _trainer(changed, tmp_path, anchor=_anchor(TINY["hidden_size"], beta=3.0))


def test_validation_runs_at_the_sparse_then_dense_cadence(tmp_path):
  """``validation.early_every`` before ``dense_from``, ``every`` from it (`ValidationConfig.due`):
  the trainer validates at exactly those steps."""
  cfg = _cfg(steps=6)
  cfg = dataclasses.replace(cfg, validation=dataclasses.replace(
      cfg.validation, every=1, early_every=3, dense_from=5))
  trainer, _ = _trainer(cfg, tmp_path)
  trainer.run()
  trainer.close()
  rows = read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in rows if "eval/mean@4" in r] == [3, 5, 6]
