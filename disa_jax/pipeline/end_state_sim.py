"""The end-state rule's error rates by simulation (issue 62, item 2): how often the rule of
`dynamics.end_state` calls a simulated curve flat, moving or unresolved.

Each scenario is a curve over the end-state window of the default job (`WINDOW`: measurements
every 16 steps at steps 672..880, the window of configs/main.py's default preset) plus noise of
two parts: the measurement's Monte Carlo error (white, its standard error known to the fit, as
``kl_decomposed_se`` is) and the policy's own wandering between measurements, an AR(1) process of
lag-1 correlation ``rho`` (unknown to the fit). The curves are flat, or still falling by a share of
their value at the window's start, linearly or as a decaying exponential (most of the fall early
in the window). The levels are the default job's final KL (0.015-0.027 nats,
docs/reports/default_8af3d05.json, the one-anchor job) and 0.3-1 nat; the noise at the default
job's level is its per-measurement scatter
(`DEFAULT_NOISE`: a total SD of 0.001 nats, half of it Monte Carlo error, the size of the
Paule-Mandel excess scatter ``tau`` its quieter runs show), and 3% of the level at 0.3-1 nat (GRPO's
``tau`` at KL 1.2-1.3 in the same report: 1.5-3%).

The rule's own code decides every draw (`dynamics.wls_change` and `dynamics.equivalence`,
vectorised over draws); the draws are seeded, so the report is reproducible. Regenerate the
committed report and its table with::

  python -m disa_jax.pipeline.end_state_sim --out docs/reports/end_state_rule

which writes ``end_state_rule.json`` and ``end_state_rule.md`` (the table docs/objectives.md
quotes). ``--draws`` sets the draws per scenario (default 4000; about a minute on 2 cores).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from disa_jax import codec
from disa_jax.pipeline import dynamics as D

WINDOW = np.arange(672, 881, 16)  # the default job's end-state window (14 measurements)
DEFAULT_NOISE = 0.001  # nats: the default job's per-measurement SD at KL 0.015-0.027
LARGE_NOISE = 0.03  # of the level, at 0.3-1 nat
MC_SHARE = 0.5  # the Monte Carlo error's share of the noise SD (the rest: the policy's wandering)
VERDICTS = ("flat", "moving", "unresolved")


@dataclasses.dataclass(frozen=True)
class Scenario:
  """One simulated curve and its noise.

  Attributes:
    level: the curve's value at the window's last step (nats).
    fall: the share of its value at the window's start it loses across the window (0: flat).
    shape: 'linear' | 'exponential' (exp(-3 u) over the window u in [0, 1]: most of the fall
      early).
    noise: the SD of one measurement's noise (nats).
    rho: the lag-1 correlation of the wandering part between consecutive measurements.
    mc_share: the Monte Carlo error's share of ``noise`` (white; its SE is given to the fit).
  """
  level: float
  fall: float
  shape: str = "linear"
  noise: float = DEFAULT_NOISE
  rho: float = 0.3
  mc_share: float = MC_SHARE

  def __post_init__(self):
    if not (self.level > 0 and 0 <= self.fall < 1 and self.shape in ("linear", "exponential")
            and self.noise > 0 and 0 <= self.rho < 1 and 0 < self.mc_share <= 1):
      raise ValueError(f"a scenario needs level > 0, fall in [0, 1), shape 'linear' or "
                       f"'exponential', noise > 0, rho in [0, 1), mc_share in (0, 1], got {self}")

  def truth(self, steps: np.ndarray) -> np.ndarray:
    """``[n]`` the noiseless curve at ``steps``."""
    u = (steps - steps[0]) / (steps[-1] - steps[0])
    start = self.level / (1.0 - self.fall)
    if self.shape == "linear":
      return start + (self.level - start) * u
    k = 3.0
    return self.level + (start - self.level) * (np.exp(-k * u) - np.exp(-k)) / (1.0 - np.exp(-k))

  def draw(self, steps: np.ndarray, draws: int, rng: np.random.Generator
           ) -> tuple[np.ndarray, np.ndarray]:
    """``[draws, n]`` noisy curves and their Monte Carlo standard errors."""
    n = steps.size
    mc = self.mc_share * self.noise
    wander = np.sqrt(max(self.noise ** 2 - mc ** 2, 0.0))
    e = rng.normal(size=(draws, n))
    ar = np.empty_like(e)
    ar[:, 0] = e[:, 0]
    for i in range(1, n):  # stationary AR(1) of unit variance
      ar[:, i] = self.rho * ar[:, i - 1] + np.sqrt(1.0 - self.rho ** 2) * e[:, i]
    y = self.truth(steps)[None] + wander * ar + mc * rng.normal(size=(draws, n))
    return y, np.full_like(y, mc)


def rates(cfg: D.EndStateConfig, scenario: Scenario, *, steps: np.ndarray = WINDOW,
          draws: int = 4000, seed: int = 0) -> dict[str, float]:
  """The share of each verdict of the rule ``cfg`` over ``draws`` seeded draws of ``scenario``."""
  y, se = scenario.draw(np.asarray(steps, np.float64), draws, np.random.default_rng(seed))
  fit = D.wls_change(steps, y, se, serial=cfg.serial)
  verdict = D.equivalence(fit["change"], fit["change_se"], fit["df"],
                          fit["value"] - fit["change"] / 2.0, cfg)["verdict"]
  return {v: float(np.mean(verdict == v)) for v in VERDICTS}


def scenarios() -> list[Scenario]:
  """The report's scenarios: at the default job's levels and at 0.3-1 nat, flat and falling by 30%
  and 50% (both shapes), at rho 0 / 0.3 / 0.6."""
  out = []
  for level in (0.015, 0.027, 0.3, 1.0):
    noise = DEFAULT_NOISE if level < 0.1 else LARGE_NOISE * level
    for rho in (0.0, 0.3, 0.6):
      out.append(Scenario(level=level, fall=0.0, noise=noise, rho=rho))
      out += [Scenario(level=level, fall=fall, shape=shape, noise=noise, rho=rho)
              for fall in (0.3, 0.5) for shape in ("linear", "exponential")]
  return out


# The rule of issue 44 (a 0.02-nat floor, 10% of the value, measurements taken as independent),
# for comparison: the margin the issue measured as unable to fail at the default job's KL.
OLD_RULE = D.EndStateConfig(delta_abs=0.02, delta_rel=0.1, serial="none")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScenarioRates:
  """One scenario (its fields inline) and the share of draws called each verdict (`VERDICTS`)
  under the rule and under `OLD_RULE`."""
  scenario: Scenario = codec.field(inline=True)
  rule: Mapping[str, float]
  old_rule: Mapping[str, float]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuleReport:
  """The simulation's report (docs/reports/end_state_rule.json, `report`): the rule and the old
  one, the window's steps, the draws per scenario, the seed and every scenario's rates."""
  rule: D.EndStateConfig
  old_rule: D.EndStateConfig
  steps: tuple[int, ...]
  draws: int
  seed: int
  scenarios: tuple[ScenarioRates, ...]


def report(cfg: D.EndStateConfig, *, draws: int = 4000, seed: int = 0,
           steps: np.ndarray = WINDOW) -> RuleReport:
  """Every scenario's verdict shares under ``cfg`` and under `OLD_RULE` (same draws)."""
  rows = [ScenarioRates(scenario=sc,
                        rule=rates(cfg, sc, steps=steps, draws=draws, seed=seed + i),
                        old_rule=rates(OLD_RULE, sc, steps=steps, draws=draws, seed=seed + i))
          for i, sc in enumerate(scenarios())]
  return RuleReport(rule=cfg, old_rule=OLD_RULE, steps=tuple(int(s) for s in steps), draws=draws,
                    seed=seed, scenarios=tuple(rows))


def markdown(rep: RuleReport) -> list[str]:
  """The report's table: per scenario, the share called flat / moving / unresolved."""
  r = rep.rule
  out = [f"End-state rule by simulation ({rep.draws} draws per scenario, seed {rep.seed}; "
         f"window steps {rep.steps[0]}..{rep.steps[-1]}, {len(rep.steps)} measurements; "
         f"margin max({r.delta_rel:g} x level, {r.delta_abs:g}), {r.level:.0%} "
         f"interval, serial correlation '{r.serial}'). "
         "Old rule: max(0.02, 0.1 x level), independent measurements.", "",
         "| level (nats) | fall | shape | noise SD | rho | flat | moving | unresolved | "
         "old rule: flat |", "|--:|--:|---|--:|--:|--:|--:|--:|--:|"]
  for row in rep.scenarios:
    s, v = row.scenario, row.rule
    shape = "-" if s.fall == 0 else s.shape
    out.append(f"| {s.level:g} | {s.fall:.0%} | {shape} | {s.noise:.3g} | {s.rho:g} | "
               f"{v['flat']:.1%} | {v['moving']:.1%} | {v['unresolved']:.1%} | "
               f"{row.old_rule['flat']:.1%} |")
  return out


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=Path, default=Path("docs/reports/end_state_rule"),
                      help="path stem: writes <out>.json and <out>.md")
  parser.add_argument("--draws", type=int, default=4000)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.draws < 100:
    parser.error(f"--draws must be >= 100, got {args.draws}")
  rep = report(D.EndStateConfig(), draws=args.draws, seed=args.seed)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.with_suffix(".json").write_text(json.dumps(codec.encode(rep), indent=1) + "\n")
  args.out.with_suffix(".md").write_text("\n".join(markdown(rep)) + "\n")
  print("\n".join(markdown(rep)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
