"""Every seed the main job uses, derived in one place from its base seed (`MainConfig.seed`).

Two kinds of stream:

- `JOB_STREAMS`: drawn once per job (one Stage 1 pool, one anchor, one N-study), the base seed
  plus a fixed offset (plus the Stage 1/2 data seed d where a replicate is drawn again: a run's
  ``data_seed``, and each anchor replica d = 0..R-1 of `MainConfig.anchor_replicas`, which draws its
  own Stage 1 pool, Stage 2 fit and 'exact+noise' offsets, its Stage 3 seeds nested within it).
- `RUN_STREAMS`: drawn once per evaluated model. Each is a hash of (base seed, the stream's tag,
  the run's identity, its Stage 3 seed), so that no two runs and no two Stage 3 seeds of one run
  share a measurement's or an evaluation's samples: the seed-level values a Welch test compares
  are independent draws. (Before issue 44 every run tracked with base + 9 and every evaluation
  sampled with base + 8 at step 0: the same random keys in every run, so the Monte Carlo errors of
  a method's seeds were correlated and their spread understated the error of their mean.)

Stage 1 samples with its config section's own seed (``stage1.sampling.seed``, + d for data seed
d: `SumJob._stage12_configs`). Stage 3 training itself is seeded by the Stage 3 seed alone (`TrainConfig.seed`): runs of different
methods with the same Stage 3 seed share their rollout key stream (common random numbers, kept on
purpose: a run's identity is (method, Stage 3 seed), so a preset reuses another's run). Between two
methods a shared stream can only correlate their seed-level values positively, which makes the
unpaired Welch test conservative, never anti-conservative; between the seeds of one method the
streams differ.
"""
from __future__ import annotations

import hashlib

import numpy as np

# stream -> (offset from the base seed, what it seeds); the value is base + offset (+ d).
JOB_STREAMS = {
    "stage2_fit": (0, "Stage 2's fit of data seed d (+ d)"),
    "nstudy": (0, "the App. C.3 command's subset and subsamples"),
    "anchor_study": (0, "the sigma_g study's subsamples and folds"),
    "noise_anchor": (0, "the per-prompt offsets of the 'exact+noise' anchors of data seed d (+ d)"),
    "sft": (0, "the LoRA-SFT baseline"),
    "n_study": (11, "the report's N-study subsamples and its disjoint draws per N"),
    # the offline job's (`pipeline.offline_job`, launch/offline.py: its own base seed)
    "offline_pool": (2, "the offline job's N-study pool of proposal samples"),
    "offline_n_study": (1, "the offline job's N-study subsamples"),
    # a tiny model's warm-up (`pipeline.sum_models`: the base is the model's own `WarmupSpec.seed`)
    "warmup_data": (1, "the warm-up's batches of made-up answers"),
}
# stream -> (tag, what it seeds); the value is a hash of (base, tag, run, Stage 3 seed).
RUN_STREAMS = {
    "eval_sampling": (7, "an evaluation's sampled metrics (Mean@k, pass@k)"),
    "eval_exact": (8, "an evaluation's Monte Carlo KL terms"),
    "track": (9, "Stage 3's exact measurements every track.every steps (each step hashed again: "
                 "`disa_jax.eval.exact.measurement_seed`)"),
}


def job_seed(base: int, stream: str, d: int = 0) -> int:
  """The seed of job-level ``stream`` (`JOB_STREAMS`) for Stage 1/2 data seed ``d``."""
  if stream not in JOB_STREAMS:
    raise KeyError(f"unknown job seed stream {stream!r}; the table has {sorted(JOB_STREAMS)}")
  return int(base) + JOB_STREAMS[stream][0] + int(d)


def _name_code(name: str) -> int:
  """A stable 32-bit code of a run name (Python's ``hash`` of a str changes per process)."""
  return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def run_seed(base: int, stream: str, run: str, stage3_seed: int | None) -> int:
  """The seed of per-run ``stream`` (`RUN_STREAMS`) for ``run`` at ``stage3_seed``.

  Args:
    base: the job's seed.
    stream: a key of `RUN_STREAMS`.
    run: the run's identity: its method name (a Stage 3 run) or its row name ('reference',
      'proposal', 'lora_sft').
    stage3_seed: the run's Stage 3 seed (None for a model that Stage 3 did not train).

  Returns:
    An int in [0, 2^31).
  """
  if stream not in RUN_STREAMS:
    raise KeyError(f"unknown run seed stream {stream!r}; the table has {sorted(RUN_STREAMS)}")
  if stage3_seed is not None and stage3_seed < 0:
    raise ValueError(f"run_seed: stage3_seed must be >= 0 or None, got {stage3_seed!r}")
  seed_code = 0 if stage3_seed is None else int(stage3_seed) + 1
  entropy = [int(base), RUN_STREAMS[stream][0], _name_code(run), seed_code]
  return int(np.random.SeedSequence(entropy).generate_state(1)[0] >> 1)
