"""The main job as its analysis reads it (issue 46): a frozen `JobPlan`, built once from the job's
config (`job_plan`), so that the report (`pipeline.report`, `report_md`, `grid`, `claims`) computes
from data, never from the `SumJob` that runs the stages.

A Stage 3 run is a `RunPlan`: its name, objective, anchor, Stage 1/2 data seed, Stage 3 seeds with
the name of each seed's directory and evaluation row, and its training `Regime`, read from the
run's resolved train section (`MainConfig.run_train`). The roles the claims turn on are declared
in the config, never parsed from run names: the fix, DISA and its oracle (`MainConfig.fix`,
``disa``, ``oracle``), each played when its run is in ``methods``.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from disa_jax import config as config_lib
from disa_jax.pipeline.dynamics import EndStateConfig, lr_decay_step
from disa_jax.pipeline.endpoints import EndpointsConfig
from disa_jax.pipeline.heldout import HeldoutConfig
from disa_jax.pipeline.job_config import MainConfig, RunSpec
from disa_jax.pipeline.sum_models import TinyLMSpec
from disa_jax.rl.config import TrainConfig

HELDOUT_PROMPTS = Path("data") / "sum_prompts_heldout.jsonl"  # (under the job's directory)


@dataclasses.dataclass(frozen=True)
class Regime:
  """How a Stage 3 run trains, from its resolved train section.

  Attributes:
    scale: the objective's residual scale ('sum' | 'mean'; '-' for an objective without one).
    updates: optimizer updates per rollout batch (``rollout.num_minibatches``).
    staleness: ``rollout.max_staleness`` (asynchronous rollouts; 0 = on time).
    lr: the peak ``optim.lr``.
    own_lr: the run sets its own lr (a `RunSpec` override), not the job's.
  """
  scale: str
  updates: int
  staleness: int
  lr: float
  own_lr: bool

  @classmethod
  def of(cls, train: TrainConfig, own_lr: bool) -> "Regime":
    return cls(scale=getattr(train.objective, "scale", None) or "-",
               updates=train.rollout.num_minibatches, staleness=train.rollout.max_staleness,
               lr=train.optim.lr, own_lr=own_lr)

  @property
  def label(self) -> str:
    """'<scale>, <k> update(s) per batch[, staleness <s>][, lr <lr>]' (the run's own lr only)."""
    k, s = self.updates, self.staleness
    return (f"{self.scale}, {k} update{'s' if k > 1 else ''} per batch"
            + (f", staleness {s}" if s else "") + (f", lr {self.lr:g}" if self.own_lr else ""))


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """One Stage 3 run of the job (a `RunSpec` of ``methods``, resolved).

  Attributes:
    name: the run's name (its key in ``runs``).
    objective: its objective's name ('disa', 'grpo', ...).
    maximises_reward: the objective maximises the reward (GRPO, GSPO: the claims' contrasts).
    needs_anchor: the objective reads a log Z anchor.
    anchor: 'fitted' | 'exact' | 'exact+noise' (`RunSpec.anchor`).
    sigma: the RMS of the 'exact+noise' anchor's offsets (0 otherwise).
    data_seed: the Stage 1/2 draw it reads (0 = the job's).
    replay: it replays Stage 1 samples.
    match_rows_of: the run whose rows per prompt it samples on-policy ('' = the job's G).
    seeds: its Stage 3 seeds, the job's first one first.
    rows: per seed, the name of its directory under ``stage3/`` and of its evaluation row.
    dirs: per seed, its Stage 3 directory.
    regime: how it trains (`Regime`).
    total_steps: its RL steps.
    lr_decay_step: the first RL step at the decayed learning rate (None: a constant rate).
    cell: the cell whose anchor replica it is (`MainConfig.anchor_replicas`; its own name else).
  """
  name: str
  objective: str
  maximises_reward: bool
  needs_anchor: bool
  anchor: str
  sigma: float
  data_seed: int
  replay: bool
  match_rows_of: str
  seeds: tuple[int, ...]
  rows: tuple[str, ...]
  dirs: tuple[Path, ...]
  regime: Regime
  total_steps: int
  lr_decay_step: int | None
  cell: str = ""

  def row(self, seed: int) -> str:
    """The directory / evaluation row name of Stage 3 seed ``seed``."""
    return self.rows[self.seeds.index(seed)]

  def dir(self, seed: int) -> Path:
    """The Stage 3 directory of seed ``seed``."""
    return self.dirs[self.seeds.index(seed)]


def run_row(method: str, seed: int, first_seed: int) -> str:
  """The Stage 3 directory / evaluation row of (method, seed): the method's name at the job's
  first seed, ``<method>_seed<seed>`` at another."""
  return method if seed == first_seed else f"{method}_seed{seed}"


@dataclasses.dataclass(frozen=True)
class JobPlan:
  """The main job as its analysis reads it: its runs (`RunPlan`, in ``methods`` order), the roles
  of the claims, and the few config values and paths the report prints or computes with.

  Attributes:
    dir: the job's directory (the report's outputs).
    preset, seed, beta: `MainConfig`'s.
    n_range: the task's (n_min, n_max).
    engine: the engines' kind.
    steps: the job's Stage 3 steps (``train.total_steps``).
    arch: the tiny models' architecture.
    seeds: the job's Stage 3 seeds.
    runs: every Stage 3 run, by name, in ``methods`` order.
    fix: the declared fix ('' = none; `MainConfig.fix`).
    disa, oracle: the paper's DISA and its oracle, declared (`MainConfig.disa`, ``oracle``) and
      in ``methods`` ('' = none).
    controls, compare: `MainConfig`'s.
    replay_pairs: issue 9's (run, its base without replay) pairs (`replay_pairs`).
    endpoints: the declared endpoint comparisons (A, B) (`EndpointsConfig.pairs`).
    endpoint_rules: the job's endpoints section (its step-size pilot's runs and rule, which
      `MainConfig` checked against the runs).
    end_state: the end-state rule's settings.
    label_scale: the Stage 1 labels' scale ('sum': they estimate the exact log Z).
    stage2_samples: the samples per prompt behind the anchor's labels (0 = the whole pool).
    n_study, n_study_repeats: the report's N-study.
    heldout: the held-out prompts' settings.
    replicas: per replicated cell, its run on each anchor replica d = 0..R-1
      (`MainConfig.replicated`; {} without replicas).
  """
  dir: Path
  preset: str
  seed: int
  beta: float
  n_range: tuple[int, int]
  engine: str
  steps: int
  arch: TinyLMSpec
  seeds: tuple[int, ...]
  runs: Mapping[str, RunPlan]
  fix: str
  disa: str
  oracle: str
  controls: tuple[str, ...]
  compare: tuple[str, ...]
  replay_pairs: tuple[tuple[str, str], ...]
  endpoints: tuple[tuple[str, str], ...]
  endpoint_rules: EndpointsConfig
  end_state: EndStateConfig
  label_scale: str
  stage2_samples: int
  n_study: tuple[int, ...]
  n_study_repeats: int
  heldout: HeldoutConfig
  replicas: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

  @property
  def methods(self) -> tuple[str, ...]:
    return tuple(self.runs)

  @property
  def exact_on_label_scale(self) -> bool:
    """Whether the Stage 1 labels estimate the exact log Z (the trajectory sum's: label_scale
    'sum'). On the mean scale (1/|o|) they estimate another quantity that no enumeration gives, so
    the report prints no error against the exact value for them, nor for the anchor fitted to
    them."""
    return self.label_scale == "sum"

  @property
  def heldout_prompts_path(self) -> Path:
    """The held-out prompts' file (written with ``heldout``)."""
    return self.dir / HELDOUT_PROMPTS

  @property
  def task(self) -> str:
    """The task's range as the report names it: 'n in [n_min, n_max]'."""
    return f"n in [{self.n_range[0]}, {self.n_range[1]}]"


def replay_pairs(runs: Mapping[str, RunSpec], methods: Sequence[str]
                 ) -> tuple[tuple[str, str], ...]:
  """Issue 9's replay comparisons, from the runs' specs: (m, b) for each run m that replaces a
  share of its groups' slots by Stage 1 samples (replay mode 'replace') and each run b of
  ``methods`` that is m without replay (the same `RunSpec` but for its replay section)."""
  out = []
  for m in methods:
    spec = runs[m]
    if spec.replay.enabled and spec.replay.mode == "replace":
      out += [(m, b) for b in methods
              if b != m and not runs[b].replay.enabled
              and dataclasses.replace(runs[b], replay=spec.replay) == spec]
  return tuple(out)


def replica_units(plan: JobPlan, values: Mapping[str, float]) -> dict[str, list[float]]:
  """The analysis units of claims about the anchor's error (issue 62), per cell of ``plan``: for a
  replicated cell, each anchor replica's mean over its Stage 3 seeds (R values: the replica, not
  the seed, is the independent draw of Stage 1 and the anchor); for any other run, its seeds'
  values. ``values``: by evaluation row (`RunPlan.rows`); a row without a value raises naming it.

  Returns:
    {cell or run name: its units}, in ``methods`` order.
  """
  def get(row: str) -> float:
    if row not in values:
      raise KeyError(f"replica_units: no value for row {row!r}")
    return float(values[row])
  in_replica = {r for runs in plan.replicas.values() for r in runs}
  out = {}
  for name, run in plan.runs.items():
    if name in plan.replicas:
      out[name] = [float(np.mean([get(row) for row in plan.runs[r].rows]))
                   for r in plan.replicas[name]]
    elif name not in in_replica:
      out[name] = [get(row) for row in run.rows]
  return out


def _run_plan(cfg: MainConfig, method: str, workdir: Path) -> RunPlan:
  spec, seeds = cfg.runs[method], cfg.run_seeds(method)
  train = cfg.run_train(method, seeds[0])  # (the seeds' sections differ in their seed alone)
  rows = tuple(run_row(method, s, cfg.seeds[0]) for s in seeds)
  return RunPlan(
      name=method, objective=spec.objective.name, maximises_reward=spec.objective.maximises_reward,
      needs_anchor=spec.objective.needs_anchor, anchor=spec.anchor, sigma=spec.sigma,
      data_seed=spec.data_seed, replay=spec.replay.enabled, match_rows_of=spec.match_rows_of,
      seeds=seeds, rows=rows, dirs=tuple(workdir / "stage3" / r for r in rows),
      regime=Regime.of(train, own_lr="train.optim.lr" in spec.overrides),
      total_steps=train.total_steps,
      lr_decay_step=lr_decay_step(train.total_steps, train.rollout.num_minibatches,
                                  train.optim.decay_frac),
      cell=next((c for c, runs in cfg.replicated().items() if method in runs), method))


def job_plan(cfg: MainConfig, workdir: str | Path) -> JobPlan:
  """The plan of the job of ``cfg`` in ``workdir`` (a run whose train section cannot be built
  raises naming it: ``runs.<name>: ...``)."""
  workdir = Path(workdir).resolve()
  runs = {}
  for m in cfg.methods:
    try:
      runs[m] = _run_plan(cfg, m, workdir)
    except (TypeError, ValueError) as e:
      raise ValueError(config_lib.qualify(str(e), f"runs.{m}")) from None
  t = cfg.train
  return JobPlan(
      dir=workdir, preset=cfg.preset, seed=cfg.seed, beta=cfg.beta,
      n_range=(cfg.task.n_min, cfg.task.n_max), engine=cfg.engine.kind, steps=t.total_steps,
      arch=cfg.arch, seeds=cfg.seeds, runs=runs, fix=cfg.fix,
      disa=cfg.disa if cfg.disa in runs else "", oracle=cfg.oracle if cfg.oracle in runs else "",
      controls=cfg.controls, compare=cfg.compare, replay_pairs=replay_pairs(cfg.runs, cfg.methods),
      endpoints=tuple(cfg.endpoints.pairs(cfg.methods)),
      endpoint_rules=cfg.endpoints, end_state=cfg.end_state,
      label_scale=cfg.stage1.label_scale, stage2_samples=cfg.stage2.samples, n_study=cfg.n_study,
      n_study_repeats=cfg.n_study_repeats, heldout=cfg.heldout, replicas=cfg.replicated())
