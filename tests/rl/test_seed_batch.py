"""Several Stage 3 seeds of one run as one batch dimension (`disa_jax.rl.seed_batch`).

A batch of one seed is today's run bit for bit (metrics.jsonl but its timings, final weights); each
seed of a batch of two is that seed trained alone, to float tolerance, with the sampler, the
scorer and the update batched; the batcher's rendezvous gives every seed its own lane whatever the
others do; the main job groups a method's seeds into units of ``seed_batch``.
"""
import dataclasses
import functools
import json
import re
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import main as main_config
from disa_jax.anchor import TableAnchor
from disa_jax.data.rows import save_prompts
from disa_jax.estimators.reward_transforms import RewardTransform
from disa_jax.models import Transformer
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.sum_job import SumJob, prompt_records
from disa_jax.pipeline.sum_models import TinyLMSpec, model_config, save_model
from disa_jax.rl import seed_batch
from disa_jax.rl.config import TrainConfig
from disa_jax.tasks.prompts import load_prompts
from disa_jax.tasks.sum import SumTask, task_tokenizer
from disa_jax.workflows.stage3 import Stage3Config, run_stage3

BETA = 15.0
TIMINGS = ("time/", "tokens_per_s")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """A random tiny sum-task policy (= pi_ref), 4 prompts, and an exact-log-Z-like table anchor."""
  d = tmp_path_factory.mktemp("seed_batch")
  tok = task_tokenizer()
  spec = TinyLMSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16)
  save_model(Transformer(model_config(tok, spec), rngs=nnx.Rngs(0)), str(d / "ref"))
  tok.save_pretrained(str(d / "ref"))
  task = SumTask(0, 3)
  save_prompts(prompt_records(task), str(d / "prompts.jsonl"))
  ids = [r.prompt_id for r in load_prompts(str(d / "prompts.jsonl"))]  # (as Stage 3 reads them)
  TableAnchor({p: 2.0 + i for i, p in enumerate(ids)}, beta=BETA,
              reward_transform=RewardTransform(kind="raw"), label_scale="sum").save(str(d / "anchor"))
  return d


def _cfg(tiny, workdir, seed: int) -> Stage3Config:
  """DISA on the exact-like anchor, 2 steps of 2 prompts x G = 4, 2 mini-batches (pi_ref and
  pi_old passes), the exact tracker every step: every routed part of a step."""
  ref = str(tiny / "ref")
  return Stage3Config.from_config(dict(
      workdir=str(workdir), model=dict(policy_path=ref, dtype="float32", remat=False),
      data=dict(train_path=str(tiny / "prompts.jsonl"), reward="sum_task", rendering="plain",
                anchor_path=str(tiny / "anchor")),
      engine=dict(kind="jax", dtype="float32", separate_process=False),
      mesh=dict(fsdp=1, num_devices=1), export_dtype="float32",
      exact_target=dict(reference_path=ref, beta=BETA, kl_samples=4, seed=100 + seed),
      train=dict(
          objective=dict(name="disa", beta=BETA, scale="sum", reward_transform={"kind": "raw"},
                         omega="one"),
          optim=dict(lr=1e-2, weight_decay=0.0),
          rollout=dict(prompts_per_batch=2, group_size=4, max_prompt_len=32, max_response_len=8,
                       num_minibatches=2, micro_batch_rows=2, share_prompts=True),
          total_steps=2, seed=seed, progress_bar=False, tensorboard=False,
          validation=dict(every=1, at_start=False),
          checkpoint=dict(every=1, keep=1, async_save=False))))


def _rows(workdir):
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [{k: v for k, v in r.items() if not k.startswith(TIMINGS)} for r in rows]


def _weights(workdir):
  """The exported policy's tensors by name (every shard of final/)."""
  files = sorted((workdir / "final").glob("*.safetensors"))
  assert files, f"no export in {workdir / 'final'}"
  return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def alone(tiny, tmp_path_factory):
  """Seeds 0 and 1, each trained alone by `run_stage3` in this thread (today's run)."""
  d = tmp_path_factory.mktemp("alone")
  for s in (0, 1):
    run_stage3(_cfg(tiny, d / f"seed{s}", s))
  return d


@pytest.mark.slow
def test_a_batch_of_one_seed_is_todays_run_bit_for_bit(tiny, alone, tmp_path):
  (run,) = seed_batch.train_together([functools.partial(run_stage3, _cfg(tiny, tmp_path, 0))])
  assert run.steps_run == 2 and run.export == tmp_path / "final"
  mine, today = _rows(tmp_path), _rows(alone / "seed0")
  assert [r["step"] for r in mine] == [1, 2] and "exact/kl_decomposed" in mine[-1]
  assert mine == today
  theirs = _weights(alone / "seed0")
  for name, w in _weights(tmp_path).items():
    np.testing.assert_array_equal(w, theirs[name], err_msg=name)


@pytest.mark.slow
def test_each_seed_of_a_batch_is_that_seed_trained_alone(tiny, alone, tmp_path):
  batcher = seed_batch.SeedBatcher(2)
  runs = seed_batch.train_together(
      [functools.partial(run_stage3, _cfg(tiny, tmp_path / f"seed{s}", s)) for s in (0, 1)],
      batcher=batcher)
  assert [r.steps_run for r in runs] == [2, 2]
  # every routed part of the run ran batched: the sampler (rollouts and the tracker), the pi_ref
  # pass, the micro step and the optimizer step (TB reads no pi_old)
  assert {"update.micro", "update.finish", "score.reference"} <= set(batcher.roles)
  assert any(r.startswith("sampler") for r in batcher.roles)
  assert _rows(alone / "seed0") != _rows(alone / "seed1")  # (two seeds: two different runs)
  for s in (0, 1):
    mine, theirs = _rows(tmp_path / f"seed{s}"), _rows(alone / f"seed{s}")
    assert [sorted(r) for r in mine] == [sorted(r) for r in theirs]
    for a, b in zip(mine, theirs):
      for k, v in b.items():
        np.testing.assert_allclose(a[k], v, rtol=2e-4, atol=2e-5, err_msg=f"seed {s} {k}")
    # Adam divides by sqrt(v): where a gradient is ~0, the batched program's other rounding moves
    # that weight by a visible share of one step (lr = 1e-2; 8e-6 seen on one CPU type), so the
    # weights are compared to 1e-3 of a step; another seed's run differs by whole steps.
    ref = _weights(alone / f"seed{s}")
    for name, w in _weights(tmp_path / f"seed{s}").items():
      np.testing.assert_allclose(w, ref[name], rtol=1e-4, atol=1e-5, err_msg=f"seed {s} {name}")
    other = _weights(alone / f"seed{1 - s}")
    assert max(np.abs(w - other[n]).max() for n, w in ref.items()) > 1e-3  # (the check can fail)


def _in_threads(batcher, fns):
  """Runs each of ``fns`` in a member thread of ``batcher``; their results or exceptions."""
  out = [None] * len(fns)

  def work(i):
    with batcher.member():
      try:
        out[i] = fns[i]()
      except Exception as e:  # pylint: disable=broad-except
        out[i] = e

  threads = [threading.Thread(target=work, args=(i,)) for i in range(len(fns))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not any(t.is_alive() for t in threads), "a member thread is stuck"
  return out


def test_seeds_that_call_differently_each_get_their_own_lane():
  """Seed 0 calls three times, seed 1 once (and then leaves), seed 2 twice with another shape:
  every call returns what the unbatched function returns, one program per role and shape."""
  batcher = seed_batch.SeedBatcher(3)
  f = jax.jit(lambda x, y: (jnp.sin(x) * y, x.sum()))
  routed = batcher.route(f, "f")

  def seed(calls):
    return [tuple(np.asarray(o) for o in routed(x, y)) for x, y in calls]

  rng = np.random.default_rng(0)
  calls = [[(rng.normal(size=(4,)).astype(np.float32), np.float32(i + k)) for k in range(n)]
           for i, n in enumerate((3, 1))]
  calls.append([(rng.normal(size=(2, 3)).astype(np.float32), np.float32(7 + k)) for k in range(2)])
  out = _in_threads(batcher, [functools.partial(seed, c) for c in calls])
  for mine, asked in zip(out, calls):
    assert len(mine) == len(asked)
    for got, (x, y) in zip(mine, asked):
      want = f(x, y)
      np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
      np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
  # firings: {seed 0, seed 1} + {seed 2}; {seed 0} + {seed 2}; {seed 0}: 5 groups, 2 programs
  assert batcher.roles["f"] == 5 and batcher.programs() == 2
  assert routed(calls[0][0][0], np.float32(1.0))[1] == pytest.approx(float(calls[0][0][0].sum()))


def test_an_error_in_a_group_reaches_its_seeds_and_a_failed_seed_holds_no_one_up():
  batcher = seed_batch.SeedBatcher(3)
  routed = batcher.route(jax.jit(lambda x: jnp.log(x)), "log")
  bad = batcher.route(jax.jit(lambda x: x.reshape(3)), "reshape")  # fails for 4 elements

  def fails_first():
    raise ValueError("seed 1 fails before any call")

  out = _in_threads(batcher, [lambda: [float(routed(np.float32(2.0))) for _ in range(2)],
                              fails_first, lambda: bad(np.zeros(4, np.float32))])
  assert out[0] == [pytest.approx(np.log(2.0))] * 2
  assert isinstance(out[1], ValueError)
  assert isinstance(out[2], TypeError) and "reshape" in str(out[2])


def test_seeds_of_different_runs_are_refused_naming_the_field():
  router = seed_batch._Router(seed_batch.SeedBatcher(2))  # pylint: disable=protected-access
  sync_save = dataclasses.replace(TrainConfig().checkpoint, async_save=False)
  fake = lambda workdir, **over: types.SimpleNamespace(
      workdir=workdir, cfg=dataclasses.replace(TrainConfig(), checkpoint=sync_save, **over),
      parts=types.SimpleNamespace(
          updater=types.SimpleNamespace(param_shapes=lambda: {"w": [2, 2]})))
  routed = []
  router.batcher.route = lambda fn, role, static_argnums=(): routed.append(role) or fn
  with pytest.raises(AttributeError):  # the first trainer is routed (a fake updater has no step)
    router(fake("/a", seed=0))
  with pytest.raises(ValueError, match=r"seeds trained together must be one run but for their "
                     r"seed: /b has train\.optim\.lr=0\.5, /a has 1e-06"):
    router(fake("/b", seed=1, optim=dataclasses.replace(TrainConfig().optim, lr=0.5)))
  with pytest.raises(ValueError, match=r"/c: train\.checkpoint\.async_save must be False"):
    router(types.SimpleNamespace(workdir="/c", cfg=dataclasses.replace(TrainConfig(), seed=2)))


def test_the_job_trains_each_methods_seeds_in_units_of_seed_batch(tmp_path):
  c = main_config.get_config("claims")
  assert c.seed_batch == 1  # a field of the config, so --config.seed_batch=S sets it
  c.seed_batch = 2
  c.methods, c.compare, c.controls = ("disa", "grpo"), (), ()
  job = SumJob(MainConfig.from_config(c), tmp_path, progress=False)
  todo = [("disa", s) for s in range(5)] + [("grpo", 0), ("grpo", 2)]
  assert job.stage3_units(todo) == [[("disa", 0), ("disa", 1)], [("disa", 2), ("disa", 3)],
                                    [("grpo", 0), ("grpo", 2)], [("disa", 4)]]
  c.seed_batch = 0
  with pytest.raises(ValueError, match="seed_batch must be an int >= 1, got 0"):
    MainConfig.from_config(c)


def test_the_job_starts_the_runs_with_the_most_work_first(tmp_path):
  """The default job's units: the fix (its replayed rows add a third to the sequences) first, then
  FlowRL (its trainable log Z head), then the runs of equal work in method order (in method order
  the last FlowRL run ran alone on two workers for 54 s)."""
  job = SumJob(MainConfig.from_config(main_config.get_config()), tmp_path, progress=False)
  todo = [(m, s) for m in job.cfg.methods for s in job.cfg.run_seeds(m)]
  methods = [re.sub(r"_rep\d$", "", unit[0][0]) for unit in job.stage3_units(todo)]
  assert methods == (["disa_pos_replay"] * 5 + ["flowrl_paper"] * 5 + ["disa"] * 5
                     + ["disa_exact"] * 5 + ["grpo"] * 5)
  fix, flowrl, grpo = (job.stage3_cfgs[(m, 0)].train.work
                       for m in ("disa_pos_replay", "flowrl_paper", "grpo"))
  assert fix == (880 * 8 * 24, False) and flowrl == (880 * 8 * 16, True) and grpo[1] is False
