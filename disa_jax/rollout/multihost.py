"""Rollout across processes: completions gathered from every host, weights pushed to every host.

In a multi-process run each host leader's generation process samples a slice of a step's prompts;
`allgather_completions` gives every process all of them (with their rewards and grading errors).
After an update, `push_weights` exports the (cross-host sharded) policy as a flat push
(`flat_weights.export`: cast and gathered on the devices, bucket by bucket); only the host leaders
copy the buckets to their host and load them into their local engine, the other processes copy
nothing. Both are collectives: every process calls them. In a single process they reduce to the
local completions and an export + ``engine.update_weights``.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from disa_jax.parallel import distributed
from disa_jax.rollout import flat_weights
from disa_jax.rollout.types import FINISH_REASONS, Completion


def host_weights(model: Any, dtype: Any = None,
                 bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES
                 ) -> flat_weights.FlatWeights | None:
  """Collective: ``model``'s weights as a flat push in buckets of ``bucket_bytes`` (the same on
  every process), copied to the host on host leaders only (None elsewhere); an owned copy, valid
  after later updates donate the parameters."""
  return flat_weights.export(model, dtype, bucket_bytes=bucket_bytes,
                             fetch=distributed.is_host_leader())


def push_weights(model: Any, engine: Any, dtype: Any = None,
                 bucket_bytes: int = flat_weights.DEFAULT_BUCKET_BYTES) -> None:
  """Collective: exports ``model``'s weights (`host_weights`) and, on each host leader, loads them
  into ``engine``. In a single process whose engine is in this process and loads a model's
  parameters (`JaxSampler.load_params`), they are copied on the devices instead (the same values,
  no host copies).

  ``engine`` may be None on processes that are not host leaders.
  """
  if jax.process_count() == 1 and hasattr(engine, "load_params"):
    engine.load_params(model, dtype)
    return
  flat = host_weights(model, dtype, bucket_bytes)
  if distributed.is_host_leader():
    if engine is None:
      raise ValueError("the host leader process has no generation engine (engine=None)")
    engine.update_weights(flat)


def allgather_completions(local: list[Completion], rewards: np.ndarray,
                          errors: np.ndarray | None = None
                          ) -> tuple[list[Completion], np.ndarray, np.ndarray]:
  """Every process's completions, ``[R_p]`` rewards and grading errors, concatenated in process
  order (collective).

  Completions are ragged, so each process pads its rows to the largest row count and length of
  any process (one small all-gather of the sizes first), all-gathers, and unpads.

  Args:
    local: this process's `Completion` list (may be empty).
    rewards: ``[len(local)]`` float32 rewards of ``local``.
    errors: ``[len(local)]`` bool grading errors of ``local`` (default: none).

  Returns:
    (completions of all processes ``[sum_p R_p]``, rewards ``[sum_p R_p]``, errors ``[sum_p R_p]``).
  """
  rewards = np.asarray(rewards, np.float32).reshape(-1)
  if rewards.shape[0] != len(local):
    raise ValueError(f"allgather_completions: {len(local)} completions but rewards of shape "
                     f"{rewards.shape}")
  errors = (np.zeros(len(local), bool) if errors is None
            else np.asarray(errors, bool).reshape(-1))
  if jax.process_count() == 1:
    return list(local), rewards, errors
  width = max((len(c.token_ids) for c in local), default=0)
  sizes = distributed.process_allgather(np.array([len(local), width], np.int64))
  sizes = sizes.reshape(jax.process_count(), 2)  # [num_processes, (rows, width)]
  rows, width = max(int(sizes[:, 0].max()), 1), max(int(sizes[:, 1].max()), 1)
  buf = {"tok": np.zeros((rows, width), np.int32), "lp": np.zeros((rows, width), np.float32),
         "raw": np.zeros((rows, width), np.float32), "has_raw": np.zeros((rows,), np.int8),
         "length": np.zeros((rows,), np.int32), "finish": np.zeros((rows,), np.int8),
         "reward": np.zeros((rows,), np.float32), "error": np.zeros((rows,), np.int8)}
  for i, c in enumerate(local):
    n = len(c.token_ids)
    buf["tok"][i, :n], buf["lp"][i, :n], buf["length"][i] = c.token_ids, c.logprobs, n
    if c.raw_logprobs is not None:
      buf["raw"][i, :n], buf["has_raw"][i] = c.raw_logprobs, 1
    buf["finish"][i] = FINISH_REASONS.index(c.finish_reason)
    buf["reward"][i], buf["error"][i] = rewards[i], errors[i]
  got = distributed.process_allgather(buf)  # each [num_processes, rows, ...]
  out, out_r, out_e = [], [], []
  for p in range(jax.process_count()):
    for i in range(int(sizes[p, 0])):
      n = int(got["length"][p, i])
      out.append(Completion(got["tok"][p, i, :n], got["lp"][p, i, :n],
                            got["raw"][p, i, :n] if got["has_raw"][p, i] else None,
                            FINISH_REASONS[int(got["finish"][p, i])]))
      out_r.append(got["reward"][p, i])
      out_e.append(bool(got["error"][p, i]))
  return out, np.asarray(out_r, np.float32), np.asarray(out_e, bool)
