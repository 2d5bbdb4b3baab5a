"""Issue 63's experiment on the anchor testbed: baseline against coupling (docs/preregistration.md,
"Baseline against coupling").

    python -m launch.main --workdir=W --config=configs/main.py:coupling_pilot      # step sizes
    python -m launch.main --workdir=W --config=configs/main.py:coupling_onpolicy   # after the pilot
    python -m launch.main --workdir=W --config=configs/main.py:coupling_offpolicy

Every preset starts from the anchor testbed's Stage 3 setup (`configs/main.py:_anchor_testbed_rl`:
its pinned models, Stages 1-2, held-out split, 600 steps, dense early tracking) and takes its cells
from the job's run table (`configs/main.py:runs`), changing only what the design names.

On-policy block (sum scale, one update per batch): the cells `ONPOLICY_CELLS` x the clips `CLIPS`,
each (cell, clip) at its own step size from `PILOT_LRS`, the largest the pilot shows stable
(`PILOT_RULE`). Off-policy block (mean scale, the paper's regime): `OFFPOLICY_CELLS` with 4
updates per batch, omega = min(w, 10), staleness k in `STALENESS`, `OFFPOLICY_SEEDS`, the fitted
anchor on `ANCHOR_REPLICAS` independent Stage 1-2 replicas.
"""
import copy

import ml_collections


# On-policy cells: run names of `configs/main.py:runs` ('disa_exact_centred' is built here).
ONPOLICY_CELLS = ("disa_exact", "disa", "disa_exact_centred", "vargrad", "flowrl_paper")
# train.optim.grad_clip per clip arm: the job's global-norm clip 1.0, and none (<= 0 disables).
CLIPS = {"c1": 1.0, "c0": 0.0}
PILOT_LRS = (1e-4, 3e-4, 1e-3)
# The pilot's rule, as the off-policy pilot's (docs/preregistration.md, "The off-policy part"):
# stable = training P(correct) >= 0.9 at the last measurement and never below 0.153; each (cell,
# clip) runs the main experiment at its largest stable lr, and is not run when none is stable.
PILOT_RULE = {"stable_level": 0.9, "stable_floor": 0.153}
ONPOLICY_SEEDS = (0, 1, 2, 3, 4)
# The fitted anchor's cells ('disa_<clip>') run on ANCHOR_REPLICAS independent Stage 1-2 replicas
# with one Stage 3 seed each (5 runs, as the other cells' 5 seeds; its unit is a replica: issue 62
# item 5, a claim about the anchor's error is decided over replicas, not seeds of one anchor).
ONPOLICY_REPLICA_SEEDS = (0,)
# The on-policy step sizes the pilot chose, (cell, clip) -> lr, from its report
# (docs/reports/coupling_pilot.json, step_size section: every group stable at its largest lr,
# 1e-3), filled in before any main run.
ONPOLICY_LRS: dict[tuple[str, str], float] = {(cell, clip): 1e-3 for cell in ONPOLICY_CELLS
                                              for clip in CLIPS}
# The presets (the on-policy ones exist once the pilot has chosen their step sizes).
PRESETS = ("coupling_pilot",
           *(("coupling_onpolicy", "coupling_onpolicy_quick") if ONPOLICY_LRS else ()),
           "coupling_offpolicy", "coupling_offpolicy_quick")

# Off-policy cells (mean scale): the fitted anchor, FlowRL as the paper runs it, VarGrad. The
# exact log Z has no mean-scale cell: it is the trajectory sum's partition function, and with
# responses of different lengths the 1/|o| residual has none (docs/preregistration.md).
OFFPOLICY_CELLS = ("disa", "flowrl_paper", "vargrad")
STALENESS = (0, 2)
OFFPOLICY_UPDATES = 4
OFFPOLICY_LR = 3e-4  # the off-policy pilot's (TESTBED_OFFPOLICY_LR)
OFFPOLICY_SEEDS = tuple(range(10))  # FlowRL and VarGrad: 10 seeds each
ANCHOR_REPLICAS = 5  # the fitted anchor: 5 Stage 1-2 replicas x ...
REPLICA_SEEDS = (0, 1)  # ... 2 Stage 3 seeds each (10 runs; the unit is a replica's mean)
ENDPOINTS = ("kl_auc", "kl_correct_end", "steps_to_p90", "kl_end")
# Equivalence margins (nats), fixed before the runs: 10% of VarGrad's training-prompt means in the
# committed mean-scale report (anchor_testbed_offpolicy_mean_oneanchor.json since 2026-12-07: kl_auc 1.118, kl_correct_end
# 0.494).
MARGINS = {"kl_auc": 0.11, "kl_correct_end": 0.05}


def lr_tag(lr: float) -> str:
  """3e-4 -> 'lr3em4': the run-name suffix of this pilot's runs and of configs/main.py's
  off-policy pilot (`pipeline.step_size.LR_TAG` reads it back)."""
  return f"lr{lr:.0e}".replace("e-0", "em")


def _cell(table: ml_collections.ConfigDict, cell: str) -> ml_collections.ConfigDict:
  """A copy of the run table's ``cell`` ('disa_exact_centred': the oracle's run with the
  batch-centred objective, `disa_jax.rl.objectives.DisaCentred`)."""
  if cell == "disa_exact_centred":
    r = copy.deepcopy(table["disa_exact"])
    r.objective.name = "disa_centred"  # the same fields as 'disa' (a subclass adding none)
    return r
  return copy.deepcopy(table[cell])


def _with(r: ml_collections.ConfigDict, *, clip: str, lr: float,
          seeds: tuple[int, ...]) -> ml_collections.ConfigDict:
  r.lr, r.seeds = lr, seeds
  r.overrides = {"train": {"optim": {"grad_clip": CLIPS[clip]}}}  # (RunSpec reads it dotted)
  return r


def pilot_grid(table: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The pilot's runs '<cell>_<clip>_<lr tag>', seed 0."""
  g = ml_collections.ConfigDict()
  for cell in ONPOLICY_CELLS:
    for clip in CLIPS:
      for lr in PILOT_LRS:
        g[f"{cell}_{clip}_{lr_tag(lr)}"] = _with(_cell(table, cell), clip=clip, lr=lr, seeds=(0,))
  return g


def onpolicy_grid(table: ml_collections.ConfigDict, seeds: tuple[int, ...],
                  lrs: dict[tuple[str, str], float]) -> ml_collections.ConfigDict:
  """The main on-policy runs '<cell>_<clip>' at the pilot's step sizes (``lrs``)."""
  if not lrs:
    raise ValueError("configs/coupling.py ONPOLICY_LRS is empty: run the preset coupling_pilot "
                     "and fill it in from its report's step_size section first")
  g = ml_collections.ConfigDict()
  for (cell, clip), lr in lrs.items():
    own = ONPOLICY_REPLICA_SEEDS if cell == "disa" and len(seeds) > 1 else seeds
    g[f"{cell}_{clip}"] = _with(_cell(table, cell), clip=clip, lr=lr, seeds=own)
  return g


def onpolicy_compare(names: tuple[str, ...]) -> tuple[str, ...]:
  """The declared comparisons per clip arm (those whose two cells both run)."""
  out = []
  for clip in CLIPS:
    for a, b in (("disa_exact", "vargrad"), ("disa_exact_centred", "vargrad"),
                 ("disa_exact", "disa_exact_centred"), ("disa", "vargrad"),
                 ("disa", "flowrl_paper"), ("disa", "disa_exact")):
      if f"{a}_{clip}" in names and f"{b}_{clip}" in names:
        out.append(f"{a}_{clip}:{b}_{clip}")
  return tuple(out)


def offpolicy_grid(table: ml_collections.ConfigDict,
                   seeds: tuple[int, ...], replica_seeds: tuple[int, ...]
                   ) -> ml_collections.ConfigDict:
  """The off-policy runs 'k<k>_u4_<cell>' on the mean scale."""
  g = ml_collections.ConfigDict()
  for k in STALENESS:
    for cell in OFFPOLICY_CELLS:
      r = _cell(table, cell)
      r.objective.update(omega="clipped_ratio", scale="mean")
      r.minibatches, r.lr, r.staleness = OFFPOLICY_UPDATES, OFFPOLICY_LR, k
      r.seeds = replica_seeds if cell == "disa" else seeds
      g[f"k{k}_u{OFFPOLICY_UPDATES}_{cell}"] = r
  return g


def offpolicy_compare() -> tuple[str, ...]:
  """DISA against each comparator at each staleness."""
  return tuple(f"k{k}_u{OFFPOLICY_UPDATES}_disa:k{k}_u{OFFPOLICY_UPDATES}_{b}"
               for k in STALENESS for b in ("flowrl_paper", "vargrad"))


def apply(c: ml_collections.ConfigDict, preset: str) -> None:
  """Sets up ``preset`` on ``c`` (already the anchor testbed's Stage 3 job)."""
  if preset == "coupling_pilot":
    grid = pilot_grid(c.runs)
    c.track.heldout = False  # the rule reads the training prompts only
    c.endpoints.compare = ()
    c.endpoints.step_size = tuple(grid.keys())
    c.endpoints.update(PILOT_RULE)
  elif preset in ("coupling_onpolicy", "coupling_onpolicy_quick"):
    seeds = ONPOLICY_SEEDS if preset == "coupling_onpolicy" else (0,)
    grid = onpolicy_grid(c.runs, seeds, ONPOLICY_LRS)
    c.anchor_replicas = ANCHOR_REPLICAS if preset == "coupling_onpolicy" else 1
    c.endpoints.compare = onpolicy_compare(tuple(grid.keys()))
    c.endpoints.endpoints = ENDPOINTS
    c.endpoints.readings = tuple(CLIPS)  # the declared readings per clip arm (pipeline.readings)
  else:
    quick = preset == "coupling_offpolicy_quick"
    grid = offpolicy_grid(c.runs, (0,) if quick else OFFPOLICY_SEEDS,
                          (0,) if quick else REPLICA_SEEDS)
    c.anchor_replicas = 1 if quick else ANCHOR_REPLICAS
    c.stage1.label_scale = "mean"  # the fitted anchor's labels on the runs' residual scale
    c.endpoints.compare = offpolicy_compare()
    c.endpoints.equivalence = offpolicy_compare()
    c.endpoints.endpoints = ENDPOINTS
    c.endpoints.margins = ml_collections.ConfigDict(MARGINS)
  c.runs.update(grid)
  c.methods = tuple(grid.keys())
  c.seeds = (0,)
