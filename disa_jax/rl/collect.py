"""Rollout: the first part of a Stage 3 step. Samples and grades one `RolloutBatch`.

`RolloutCollector.collect(step)` takes the step's P prompts from the `PromptStream`, samples G
responses per prompt with the rollout `Engine` (its own process in production), grades them with
the run's `RewardFn`, and keeps them as prompt-major sequences (packed into rows later, by the
scorer and the update). With Stage 1
replay (`ReplayConfig`), k of a prompt's G rows are Stage 1 proposal samples (`disa_jax.rl.replay`)
and the engine samples the other G - k; prompts without Stage 1 samples get a second on-policy call
for their k slots, so every group has G rows.

Multi-host (``jax.process_count() > 1``): each host leader's generation process samples a
contiguous slice of the step's prompts (``SamplingParams.prompt_index_offset`` keeps the samples
those of a single engine handed the whole batch), grades its slice, and the completions, rewards and
grading errors are all-gathered, so every process holds the same `RolloutBatch`. The sampling seed
of step k is derived from (seed, k) (`disa_jax.rl.seeds`), so a resumed run samples what an
uninterrupted one would. The collector is built from the run's ``rollout``, ``replay`` and
``validation`` sections and its `RolloutTask` (`disa_jax.rl.inputs`).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from disa_jax.eval import metrics as eval_metrics
from disa_jax.parallel import distributed
from disa_jax.rewards.graded import Graded, Response, RewardFn
from disa_jax.rl import seeds
from disa_jax.rl.batch import RolloutBatch
from disa_jax.rl.config import TrainConfig
from disa_jax.rl.inputs import RolloutTask
from disa_jax.rl.prompts import PromptItem, PromptStream
from disa_jax.rl.replay import ReplaySample, replay_count
from disa_jax.rollout import multihost
from disa_jax.rollout.types import Completion, Engine, SamplingParams


def grade(reward_fn: RewardFn, decode: Callable[[Sequence[int]], str],
          items: Sequence[PromptItem], comps: Sequence[Sequence[Completion]]) -> Graded:
  """Grades ``comps`` (``[P][n]``) of ``items`` (``[P]``); rows flattened prompt-major."""
  flat = [(it, c) for it, group in zip(items, comps) for c in group]
  responses = [Response(decode(c.token_ids.tolist()), tuple(int(t) for t in c.token_ids),
                        c.finish_reason) for _, c in flat]
  graded = reward_fn(responses, [dict(it.meta) for it, _ in flat])
  if not isinstance(graded, Graded):
    raise TypeError(f"reward_fn must return a Graded (disa_jax.rewards.graded), got "
                    f"{type(graded).__name__}")
  if graded.reward.shape != (len(flat),):
    raise ValueError(f"reward_fn returned {graded.reward.shape[0]} rewards for {len(flat)} "
                     "responses")
  bad = np.flatnonzero(~np.isfinite(graded.reward))
  if bad.size:
    pids = [flat[i][0].prompt_id for i in bad[:5]]
    raise ValueError(f"reward_fn returned {bad.size} non-finite reward(s), e.g. "
                     f"{graded.reward[bad[:5]].tolist()} for prompts {pids}: a NaN or inf reward "
                     "would enter the loss; fix the reward function")
  return graded


@dataclasses.dataclass
class LocalCall:
  """One engine call's result on this process, before the all-gather.

  Attributes:
    num_items: prompts of the whole call (every process's slices).
    n: samples per prompt.
    comps: ``[P_local][n]`` this process's completions (empty off the host leaders).
    graded: their `Graded` rows ``[P_local * n]``.
    generate_s: this process's seconds in the engine.
  """
  num_items: int
  n: int
  comps: list[list[Completion]]
  graded: Graded
  generate_s: float


@dataclasses.dataclass
class LocalRollout:
  """One step's rollouts on this process before the all-gather (`RolloutCollector.sample`).

  Attributes:
    step: the RL step (0-based) the batch is for.
    version: the weights' optimizer-step count the engine sampled with.
    items: ``[P]`` the step's prompts.
    replayed: ``[P][k]`` the Stage 1 samples drawn for each prompt.
    full: indices of the prompts without Stage 1 samples (they get ``extra`` on-policy rows).
    main: the G - k samples of every prompt.
    extra: the k samples of the ``full`` prompts (None when there are none).
  """
  step: int
  version: int
  items: list[PromptItem]
  replayed: list[list[ReplaySample]]
  full: list[int]
  main: LocalCall
  extra: LocalCall | None


class RolloutCollector:
  """Samples and grades the rollout batch of each RL step (see the module docstring).

  Args:
    cfg: the run's config: its ``rollout`` (sampling settings, group size, widths), ``replay``
      (Stage 1 replay; ``fraction=0``: none) and ``validation`` (what `validate` samples)
      sections, ``seed`` (every sampling seed is derived from it, `disa_jax.rl.seeds`),
      ``shuffle`` and ``rows_per_prompt``.
    task: the prompts (streamed ``rollout.prompts_per_batch`` a step), the reward function, the
      decoder, the stop ids and the replay pool (required when ``replay`` is enabled).
    engine: this host's rollout engine (None on processes that do not lead a host).
    leaders: process indices of the host leaders (`distributed.host_leaders`).
  """

  def __init__(self, cfg: TrainConfig, task: RolloutTask, engine: Engine | None,
               leaders: list[int]):
    rollout, replay, replay_pool = cfg.rollout, cfg.replay, task.replay_pool
    rows_per_prompt = cfg.rows_per_prompt
    stream = PromptStream(task.prompts, rollout.prompts_per_batch, seed=cfg.seed,
                          shuffle=cfg.shuffle, max_prompt_len=rollout.max_prompt_len)
    if replay.enabled and replay_pool is None:
      raise ValueError(f"replay.fraction={replay.fraction} needs a Stage 1 replay pool, got None")
    if replay_pool is not None and not replay.enabled:
      raise ValueError("a replay pool was given but replay.fraction=0")
    if replay_pool is not None and replay_pool.coverage([it.prompt_id for it in stream.items]) == 0:
      raise ValueError(f"none of the {len(stream.items)} training prompt ids has a Stage 1 sample "
                       "in the replay pool")
    if rows_per_prompt < rollout.group_size:
      raise ValueError(f"rows_per_prompt={rows_per_prompt} is below rollout.group_size="
                       f"{rollout.group_size}")
    self.rollout_cfg, self.replay_cfg, self.validation_cfg = rollout, replay, cfg.validation
    self.seed, self.rows_per_prompt = cfg.seed, rows_per_prompt
    self.engine, self.stream = engine, stream
    self.reward_fn, self.decode = task.reward_fn, task.decode
    self.stop_token_ids = tuple(task.stop_token_ids)
    self.replay, self.leaders = replay_pool, leaders

  def generate(self, items: Sequence[PromptItem], params: SamplingParams
               ) -> tuple[list[list[Completion]], Graded, float]:
    """Samples ``params.n`` responses per item and grades them where the engines are.

    Returns:
      (``[P][n]`` completions, their `Graded` rows ``[P * n]`` prompt-major, this process's
      generation seconds), the same on every process.
    """
    return self.gather(self.generate_local(items, params))

  def generate_local(self, items: Sequence[PromptItem], params: SamplingParams) -> LocalCall:
    """This process's share of `generate`: its host leader's slice sampled and graded, no
    collective (safe on a rollout thread)."""
    sl = distributed.leader_slice(len(items), self.leaders)  # all items in a single process
    local = list(items[sl])
    comps, graded, t_gen = [], Graded.ok(np.zeros(0, np.float32)), 0.0
    if local:
      t0 = time.perf_counter()
      comps = self.engine.generate([list(it.token_ids) for it in local],
                                   dataclasses.replace(params, prompt_index_offset=sl.start))
      t_gen = time.perf_counter() - t0
      graded = grade(self.reward_fn, self.decode, local, comps)
    return LocalCall(len(items), params.n, comps, graded, t_gen)

  @staticmethod
  def gather(call: LocalCall) -> tuple[list[list[Completion]], Graded, float]:
    """Collective: every process's `LocalCall` -> the `generate` result, the same everywhere."""
    n = call.n
    flat, r, e = multihost.allgather_completions([c for g in call.comps for c in g],
                                                 call.graded.reward, call.graded.error)
    return ([flat[i * n:(i + 1) * n] for i in range(call.num_items)],  # [P][n]
            Graded(r, e), call.generate_s)

  def sampling(self, n: int, seed: int, **overrides: Any) -> SamplingParams:
    rc = self.rollout_cfg
    kwargs = dict(n=n, temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                  max_tokens=rc.max_response_len, stop_token_ids=self.stop_token_ids, seed=seed,
                  return_raw_logprobs=rc.old_logp_source == "engine")
    kwargs.update(overrides)
    return SamplingParams(**kwargs)

  def _draw_replay(self, step: int, items: Sequence[PromptItem]) -> list[list[ReplaySample]]:
    if self.replay is None:
      return [[] for _ in items]
    k = replay_count(self.replay_cfg.fraction_at(step), self.rollout_cfg.group_size)
    return self.replay.draw([it.prompt_id for it in items], k,
                            seed=seeds.replay_seed(self.seed, step))

  def collect(self, step: int, version: int = 0) -> RolloutBatch:
    """The graded rollout batch of RL step ``step`` (0-based), sampled by weights ``version``.

    Rows are prompt-major ``[P * R]`` with R = `TrainConfig.rows_per_prompt` (G, or G + k with
    replayed rows added); within a prompt's group the on-policy samples come first and the replayed
    Stage 1 samples (if any) last. A prompt without replay samples gets R on-policy rows.
    """
    return self.finish(self.sample(step, version))

  def sample(self, step: int, version: int = 0) -> LocalRollout:
    """This process's share of step ``step``'s rollouts (no collective; `finish` gathers them)."""
    items = self.stream.batch(step)
    rows = self.rows_per_prompt
    seed = seeds.rollout_seed(self.seed, step)
    replayed = self._draw_replay(step, items)
    k = max(len(r) for r in replayed)
    main = self.generate_local(items, self.sampling(rows - k, seed))
    full = [i for i, r in enumerate(replayed) if not r]
    extra = (self.generate_local([items[i] for i in full], self.sampling(k, seed + 1))
             if k and full else None)  # prompts without Stage 1 samples: k more on-policy samples
    return LocalRollout(step, version, items, replayed, full, main, extra)

  def finish(self, local: LocalRollout) -> RolloutBatch:
    """Collective: the `RolloutBatch` of a `sample` result, the same on every process."""
    items, replayed = local.items, local.replayed
    comps, graded, t_gen = self.gather(local.main)
    groups = [list(c) for c in comps]  # [P][on-policy samples]
    per = graded.reward.size // len(items)
    rows_r = graded.reward.reshape(len(items), per).tolist()
    rows_e = graded.error.reshape(len(items), per).tolist()
    if local.extra is not None:
      extra, extra_g, t_extra = self.gather(local.extra)
      k = local.extra.n
      t_gen += t_extra
      for j, i in enumerate(local.full):
        groups[i] += extra[j]
        rows_r[i] += extra_g.reward[j * k:(j + 1) * k].tolist()
        rows_e[i] += extra_g.error[j * k:(j + 1) * k].tolist()
    return self._assemble(items, groups, rows_r, rows_e, replayed, t_gen, local.version)

  def _assemble(self, items, groups, rows_r, rows_e, replayed, t_gen, version) -> RolloutBatch:
    resp, reward, error, is_replay, sampled, raw, finish, stored = [], [], [], [], [], [], [], []
    for group, r, e, rep in zip(groups, rows_r, rows_e, replayed):
      resp += [c.token_ids for c in group] + [s.token_ids for s in rep]
      reward += r + [s.reward for s in rep]
      error += e + [False] * len(rep)
      is_replay += [False] * len(group) + [True] * len(rep)
      sampled += [c.logprobs for c in group] + [None] * len(rep)
      raw += [c.raw_logprobs for c in group] + [None] * len(rep)
      finish += [c.finish_reason for c in group] + ["replay"] * len(rep)
      stored += [np.nan] * len(group) + [s.logp_ref for s in rep]
    return RolloutBatch(
        prompt_ids=[it.prompt_id for it in items],
        prompt_tokens=[tuple(it.token_ids) for it in items], group_size=self.rows_per_prompt,
        response_width=self.rollout_cfg.max_response_len, response_ids=resp,
        reward=np.asarray(reward, np.float32), grade_error=np.asarray(error, bool),
        is_replay=np.asarray(is_replay, bool), sampled_logp=sampled, engine_logp=raw,
        finish_reason=finish, stored_ref_logp=np.asarray(stored, np.float64), generate_s=t_gen,
        policy_version=version)

  def validate(self, items: Sequence[PromptItem], done: int) -> dict[str, float]:
    """Mean@n, pass@n and response length of the current engine weights on ``items``."""
    vc = self.validation_cfg
    params = SamplingParams(n=vc.n, temperature=vc.temperature, top_p=vc.top_p,
                            max_tokens=vc.max_tokens, stop_token_ids=self.stop_token_ids,
                            seed=seeds.validation_seed(self.seed, done))
    comps, graded, _ = self.generate(items, params)
    correct = graded.reward.reshape(len(items), vc.n) > 0.5  # [P * n] -> [P, n]
    return {f"eval/mean@{vc.n}": eval_metrics.mean_at_k(correct),
            f"eval/pass@{vc.n}": eval_metrics.pass_at_k_from_correct(correct, vc.n),
            "eval/response_length": float(np.mean([len(c.token_ids) for g in comps for c in g])),
            "eval/grade_error_share": graded.error_share}


def rollout_stats(batch: RolloutBatch) -> dict[str, float]:
  """Metrics of the on-policy rows of a rollout batch (replayed rows have their own)."""
  on = ~batch.is_replay
  lengths = np.asarray([len(t) for t, r in zip(batch.response_ids, batch.is_replay) if not r])
  sampled = np.concatenate([lp for lp, r in zip(batch.sampled_logp, batch.is_replay) if not r])
  return {
      "reward": float(batch.reward[on].mean()),
      "accuracy": float((batch.reward[on] > 0.5).mean()),
      "grade_error_share": float(batch.grade_error[on].mean()),
      "response_length": float(lengths.mean()),
      "response_length_max": float(lengths.max()),
      "truncated_frac": float(np.mean([f == "length" for f, r in zip(batch.finish_reason,
                                                                       batch.is_replay) if not r])),
      # Monte-Carlo entropy estimate of the sampling distribution: -E[log p(sampled token)].
      "entropy": float(-sampled.mean()) if sampled.size else 0.0,
      "reward_std_in_group": float(batch.grouped_reward.std(-1).mean()),
      "time/generate_s": batch.generate_s,
      "tokens_generated": float(lengths.sum()),
  }
