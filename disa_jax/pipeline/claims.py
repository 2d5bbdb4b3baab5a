"""The paper's claims on the sum task, each a verdict that can fail (issue 44).

Every comparison uses the primary KL, ``kl_decomposed`` (KL(pi || pi~) as its exact decomposition
with one Monte Carlo term: unbiased, 5-10x the precision of the plain Monte Carlo ``kl_mc``, which
the tables show beside it). The claims (`build_claims`):

1. the Stage 1 error |log Z_IS - log Z| at the largest N is below that at the smallest, each N drawn
   from its own samples (disjoint columns of the pool), paired over prompts (a one-sample t-test);
2. the fix and DISA end as close to pi~ as the oracle, DISA on the exact log Z (equivalence: the
   90% interval of the difference of their KL inside +-delta, delta = max(delta_abs, delta_rel x
   the oracle's KL), `dynamics.EndStateConfig`); which runs are DISA and the oracle is the
   report's to say (`Plan`: from the runs' specs, `pipeline.plan`);
3. their KL is below each reward maximiser's, and at matched accuracy (interpolated to the level)
   the reward maximiser's entropy over correct answers is lower;
4. the fix's KL is below each control's; each configured pair ('A<B': A's KL below B's; 'A<>B':
   they differ, either way), and each replay run against its base (`Plan.replay`).

A run that collapsed (entropy over correct answers below `COLLAPSE_ENTROPY_FRACTION` of the
target's) or diverged (KL not finite or above `DIVERGENCE_FACTOR` x the reference policy's, where
training started: training took it much farther from pi~) is a failure: KL
comparisons count failures on each side by Fisher's exact test and compare KL by Welch's test
only over the runs that did not fail, saying how many were left out (a Fisher test whose margins
cannot give p < `ALPHA` whatever the split, e.g. 3 runs a side, is undecided and left out of the
family: `seed_stats.fisher_min_p`). Every tested claim has a
p-value; Holm's correction runs over all of them (the report's family), and a claim holds only if
its adjusted p is < `ALPHA` (and the difference has the claimed sign). A claim that could not be
tested (one seed, every run failed, no level both runs reached) is "undecided", with the reason.
Each claim is flagged with the end state of the methods it compares (`dynamics.method_end_state`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from disa_jax import estimators as E
from disa_jax.pipeline import seed_stats
from disa_jax.pipeline.dynamics import PRIMARY, PRIMARY_SE, EndState, EndStateConfig, Matched
from disa_jax.pipeline.report_records import Claim, ClaimTest, Row

ALPHA = 0.05
COLLAPSE_ENTROPY_FRACTION = 0.25  # a run below this share of the target's entropy over correct
# a run above this multiple of the reference policy's KL diverged (the staleness study's diverged
# runs end at 4-19x; a run that barely trained sits near 1x either way)
DIVERGENCE_FACTOR = 2.0
SeedRows = Sequence[tuple[int, Row]]
# per seed, per accuracy level ('0.9'): the measures interpolated there (`matched_accuracy`)
MatchedRuns = Sequence[tuple[int, Mapping[str, Matched | None]]]


def parse_comparison(pair: str, where: str = "compare") -> tuple[str, str, bool]:
  """``(a, b, two_sided)`` of a declared comparison: 'A<B' (A's KL below B's) or 'A<>B' (A's and
  B's KL differ, either way); a bad form raises naming ``where``."""
  two_sided = "<>" in pair
  a, _, b = pair.partition("<>" if two_sided else "<")
  if not a or not b or a == b or "<" in b or ">" in b:
    raise ValueError(f"{where} must be 'A<B' or 'A<>B' with two different runs, got {pair!r}")
  return a, b, two_sided


@dataclasses.dataclass(frozen=True)
class Evidence:
  """What the verdicts read.

  Attributes:
    seed_rows: method -> [(Stage 3 seed, its evaluation row, `report.eval_row`)].
    method_states: method -> its end state pooled over its seeds (`dynamics.method_end_state`;
      a method without exact measurements has none).
    matched_runs: method -> [(seed, `dynamics.matched_accuracy`)].
    reference_kl: the reference policy's primary KL (None: only a non-finite KL diverged).
    end_state: the margin's settings (`EndStateConfig`).
  """
  seed_rows: Mapping[str, SeedRows]
  method_states: Mapping[str, EndState] = dataclasses.field(default_factory=dict)
  matched_runs: Mapping[str, MatchedRuns] = dataclasses.field(default_factory=dict)
  reference_kl: float | None = None
  end_state: EndStateConfig = EndStateConfig()

  def failure(self, row: Row) -> str | None:
    """'diverged' / 'collapsed' / None for one run's evaluation row."""
    kl = row[PRIMARY]
    if not np.isfinite(kl) or (self.reference_kl is not None
                               and kl > DIVERGENCE_FACTOR * self.reference_kl):
      return "diverged"
    if row["entropy_correct"] < COLLAPSE_ENTROPY_FRACTION * row["target_entropy_correct"]:
      return "collapsed"
    return None

  def split(self, m: str) -> tuple[SeedRows, dict[int, str]]:
    """(``m``'s runs that did not fail, {seed: why} of those that did)."""
    rows = self.seed_rows.get(m, ())
    failed = {s: why for s, r in rows if (why := self.failure(r))}
    return [(s, r) for s, r in rows if s not in failed], failed

  def state(self, runs: Sequence[str]) -> tuple[str, bool]:
    """('end state' | 'transient' | 'undecided' | '-', not every method at its end state)."""
    if not runs:
      return "-", False
    states = [self.method_states.get(m) for m in runs]
    if all(s is not None and s.reached for s in states):
      return "end state", False
    if any(s is not None and s.reason == "moving" for s in states):
      return "transient", True
    return "undecided", True


def claim(ev: Evidence, text: str, numbers: Mapping[str, Any], runs: Sequence[str], *,
          test: ClaimTest | None = None, why: str | None = None) -> Claim:
  """One claim before the family's correction (`finalise`): its ``test`` for a tested claim;
  None with ``why`` for one that could not be."""
  if test is None and not why:
    raise ValueError(f"claim {text!r}: an untested claim needs the reason it is undecided")
  state, transient = ev.state(runs)
  return Claim(claim=text, numbers=dict(numbers), runs=tuple(runs), test=test, why=why,
               state=state, from_transient=transient)


def _welch_test(name: str, c: seed_stats.Comparison, direction_ok: bool, note: str) -> ClaimTest:
  return ClaimTest(name=name, p=c.p, direction_ok=bool(direction_ok),
                   summary=f"Welch: diff {c.diff:+.3f}, 95% CI [{c.ci_low:+.3f}, "
                           f"{c.ci_high:+.3f}], seeds {c.n_a} / {c.n_b}{note}")


def _left_out(a: str, b: str, fa: Mapping[int, str], fb: Mapping[int, str]) -> str:
  if not fa and not fb:
    return ""
  return f" ({len(fa)} of {a}, {len(fb)} of {b} left out: failed)"


def kl_pair(ev: Evidence, a: str, b: str, two_sided: bool = False, text: str | None = None
            ) -> list[Claim]:
  """"``a``'s KL below ``b``'s" (or, ``two_sided``, "they differ"): Fisher's test of their
  failure counts when a run failed, and Welch's test over the runs that did not."""
  (ka, fa), (kb, fb) = ev.split(a), ev.split(b)
  na, nb = len(ka) + len(fa), len(kb) + len(fb)
  counts = {"failed": {a: {str(s): w for s, w in fa.items()}, b: {str(s): w for s, w in fb.items()}},
            "runs": [na, nb]}
  out = []
  if fa or fb:
    rel = "at different rates" if two_sided else "less often than"
    t = (f"{a} and {b} fail (collapse or diverge) {rel}" if two_sided else
         f"{a} fails (collapses or diverges) {rel} {b}") + " (Fisher's exact test)"
    least = seed_stats.fisher_min_p(len(fa) + len(fb), na, nb)
    if least >= ALPHA:  # no split of these counts could reject: not a test of the family
      out.append(claim(ev, t, counts | {"min_p": least}, (a, b), why=(
          f"failed {len(fa)}/{na} against {len(fb)}/{nb}: with these counts no split can reach "
          f"p < {ALPHA:g} (the smallest p they allow is {least:.3g}), so no test")))
    else:
      ok = two_sided or len(fa) / na < len(fb) / nb
      out.append(claim(ev, t, counts, (a, b), test=ClaimTest(
          name="fisher", p=seed_stats.fisher_exact(len(fa), na, len(fb), nb), direction_ok=ok,
          summary=f"Fisher: failed {len(fa)}/{na} against {len(fb)}/{nb}")))
  text = text or (f"{a}'s and {b}'s KL to the target differ" if two_sided else
                  f"{a}'s KL to the target is below {b}'s")
  text += " (Welch over the seeds that neither collapsed nor diverged)"
  va, vb = [r[PRIMARY] for _, r in ka], [r[PRIMARY] for _, r in kb]
  nums = counts | {"metric": PRIMARY, a: float(np.mean(va)) if va else None,
                   b: float(np.mean(vb)) if vb else None, "seeds": [len(va), len(vb)]}
  if min(len(va), len(vb)) < 2:
    return out + [claim(ev, text, nums, (a, b), why=(
        f"fewer than 2 seeds that did not fail on a side ({len(va)} of {na} of {a}, {len(vb)} of "
        f"{nb} of {b}): no test across seeds"))]
  c = seed_stats.welch(va, vb, a_se=[r[PRIMARY_SE] for _, r in ka],
                       b_se=[r[PRIMARY_SE] for _, r in kb])
  nums |= {"diff": c.diff, "ci95": [c.ci_low, c.ci_high], "p": c.p, "t": c.t, "df": c.df}
  test = _welch_test("welch", c, two_sided or c.diff < 0, _left_out(a, b, fa, fb))
  return out + [claim(ev, text, nums, (a, b), test=test)]


def as_close_as_oracle(ev: Evidence, m: str, oracle: str) -> Claim:
  """"``m`` ends as close to pi~ as the oracle": the 90% interval of mean KL(m) - mean KL(oracle)
  inside +-delta(oracle's KL), by two one-sided Welch tests over the runs that did not fail."""
  (km, fm), (ko, fo) = ev.split(m), ev.split(oracle)
  vm, vo = [r[PRIMARY] for _, r in km], [r[PRIMARY] for _, r in ko]
  text = (f"{m} ends as close to the target as the oracle {oracle} (KL within the equivalence "
          "margin of the oracle's; two one-sided Welch tests over seeds)")
  nums = {"metric": PRIMARY, "seeds": [len(vm), len(vo)],
          "failed": {m: {str(s): w for s, w in fm.items()}, oracle: {str(s): w for s, w in fo.items()}}}
  if min(len(vm), len(vo)) < 2:
    return claim(ev, text, nums, (m, oracle), why=(
        f"fewer than 2 seeds that did not fail on a side ({len(vm)} of {m}, {len(vo)} of "
        f"{oracle}): no test across seeds"))
  margin = float(ev.end_state.delta(np.mean(vo)))
  c = seed_stats.welch(vm, vo, a_se=[r[PRIMARY_SE] for _, r in km],
                       b_se=[r[PRIMARY_SE] for _, r in ko], level=1.0 - 2 * ALPHA)
  nums |= {m: float(np.mean(vm)), oracle: float(np.mean(vo)), "margin": margin, "diff": c.diff,
           "ci90": [c.ci_low, c.ci_high]}
  return claim(ev, text, nums, (m, oracle), test=ClaimTest(
      name="tost", p=c.tost_p(margin), direction_ok=True,
      summary=f"TOST: diff {c.diff:+.3f}, 90% CI [{c.ci_low:+.3f}, {c.ci_high:+.3f}] against "
              f"+-{margin:.3f}, seeds {c.n_a} / {c.n_b}{_left_out(m, oracle, fm, fo)}"))


def _matched_values(ev: Evidence, m: str, lvl: str) -> tuple[list[int], list[int], list[Matched]]:
  """(seeds matched by interpolation, seeds already past ``lvl`` at their first measurement,
  the matched values of the former)."""
  got = [(s, x[lvl]) for s, x in ev.matched_runs.get(m, []) if x[lvl] is not None]
  past = [s for s, v in got if v.already_past]
  return [s for s, v in got if not v.already_past], past, [v for _, v in got if not v.already_past]


def matched_entropy(ev: Evidence, m: str, c: str) -> Claim | None:
  """"At matched accuracy ``c``'s entropy over correct answers is below ``m``'s": Welch over the
  seeds interpolated to the highest level both reach with >= 2 such seeds (None: no level both
  reach at all)."""
  runs = ev.matched_runs
  levels = sorted({lvl for _, x in runs.get(m, []) for lvl, v in x.items() if v is not None} &
                  {lvl for _, x in runs.get(c, []) for lvl, v in x.items() if v is not None},
                  key=float)
  if not levels:
    return None
  usable = [lvl for lvl in levels if min(len(_matched_values(ev, x, lvl)[0]) for x in (m, c)) >= 2]
  lvl = (usable or levels)[-1]
  (sm, pm, vm), (sc, pc, vc) = _matched_values(ev, m, lvl), _matched_values(ev, c, lvl)
  text = (f"reward maximisation collapses: at P(correct) = {lvl} (interpolated), {c}'s entropy "
          f"over correct answers is below {m}'s (Welch over seeds)")
  nums = {"level": float(lvl), f"{m}_seeds": sm, f"{c}_seeds": sc, f"{m}_already_past": pm,
          f"{c}_already_past": pc, "seeds": [len(vc), len(vm)]}
  nums |= {f"{x}_{k}": [v.value(k) for v in vals] for x, vals in ((m, vm), (c, vc))
           for k in ("step", "entropy_correct", "kl_correct")}
  if not usable:
    return claim(ev, text, nums, (m, c), why=(
        f"fewer than 2 seeds per side reach P(correct) = {lvl} after their first measurement "
        f"({len(sm)} of {m}, {len(sc)} of {c}; already past it at the first: {len(pm)} / "
        f"{len(pc)}): no matched comparison"))
  w = seed_stats.welch([v.entropy_correct for v in vc], [v.entropy_correct for v in vm])
  nums |= {"diff": w.diff, "ci95": [w.ci_low, w.ci_high], "p": w.p}
  return claim(ev, text, nums, (m, c), test=_welch_test("welch", w, w.diff < 0, ""))


def stage1_disjoint_errors(log_w: np.ndarray, mask: np.ndarray, log_z: np.ndarray,
                           ms: Sequence[int]) -> dict[str, list[float]]:
  """Per N, each prompt's |log Z_IS - log Z| from its own samples: N = ms[0] from the pool's first
  ms[0] columns, the next N from the following ones, ... (the ms that fit in the pool; the samples
  of a prompt are independent draws, so the errors of different N are too).

  Args:
    log_w, mask: ``[P, N_pool]`` the pool's log-weights and validity.
    log_z: ``[P]`` the exact log Z.
    ms: the sample sizes, ascending.

  Returns:
    str(N) -> ``[P]`` errors (NaN where a prompt's block has no valid sample); {} when fewer than
    two N fit.
  """
  out, start = {}, 0
  for n in sorted(int(m) for m in ms):
    if start + n > log_w.shape[1]:
      break
    cols = slice(start, start + n)
    lz = np.asarray(E.log_z_is(log_w[:, cols], mask[:, cols]), np.float64)
    err = np.abs(lz - np.asarray(log_z, np.float64))
    out[str(n)] = np.where(np.asarray(mask[:, cols]).any(1) & np.isfinite(err), err, np.nan).tolist()
    start += n
  return out if len(out) >= 2 else {}


def stage1_claim(ev: Evidence, abs_err: Mapping[str, Sequence[float]]) -> Claim:
  """"The Stage 1 error shrinks with N": per prompt, |log Z_IS - log Z| at the smallest and the
  largest N of ``abs_err`` (N -> ``[P]`` errors, each N from its own samples), paired over the
  prompts where both are finite."""
  ns = sorted(abs_err, key=int)
  lo, hi = ns[0], ns[-1]
  a, b = np.asarray(abs_err[lo], np.float64), np.asarray(abs_err[hi], np.float64)
  ok = np.isfinite(a) & np.isfinite(b)
  text = (f"the Stage 1 error shrinks with N: |log Z_IS - log Z| at N = {hi} is below N = {lo} "
          "(independent samples per N, paired over prompts)")
  nums = {"n_small": int(lo), "n_large": int(hi), "prompts": int(ok.sum()),
          "mae": {n: float(np.nanmean(np.asarray(abs_err[n], np.float64))) for n in ns}}
  d = a[ok] - b[ok]
  if d.size < 2 or np.all(d == d[0]):
    return claim(ev, text, nums, (), why=f"{d.size} prompts with both errors: no paired test")
  t = seed_stats.one_sample(d)
  nums |= {"diff": t.mean, "ci95": [t.ci_low, t.ci_high], "p": t.p}
  return claim(ev, text, nums, (), test=ClaimTest(
      name="paired_t", p=t.p, direction_ok=t.mean > 0,
      summary=f"paired t over {t.n} prompts: mean error {nums['mae'][lo]:.3f} at N = {lo}, "
              f"{nums['mae'][hi]:.3f} at N = {hi}"))


def finalise(claims: Sequence[Claim], alpha: float = ALPHA) -> list[Claim]:
  """Holm's correction over every tested claim, then each verdict: 'holds' (adjusted p < alpha,
  the claimed sign), 'does not hold' (tested, not shown) or 'undecided' (no test)."""
  tested = [c.test for c in claims if c.test is not None]
  adjusted = iter(seed_stats.holm([t.p for t in tested]))
  out = []
  for c in claims:
    if c.test is None:
      out.append(dataclasses.replace(c, verdict="undecided", holds=False))
      continue
    t, adj = c.test, next(adjusted)
    holds = bool(adj < alpha and t.direction_ok)
    sign = "" if t.direction_ok else "; the difference has the other sign"
    why = c.why if holds else (f"p = {t.p:.3g}, Holm-adjusted over the report's {len(tested)} "
                               f"tests {adj:.3g} (needs < {alpha:g}){sign}")
    out.append(dataclasses.replace(c, test=dataclasses.replace(t, p_holm=float(adj)), why=why,
                                   verdict="holds" if holds else "does not hold", holds=holds))
  return out


@dataclasses.dataclass(frozen=True)
class Plan:
  """The claims a report makes (from the job's `pipeline.plan.JobPlan`): ``fix`` ('' = none),
  ``disa`` and its ``oracle`` ('' = none), the reward maximisers ``contrasts``, the fix's
  ``controls``, the declared ``compare`` pairs and the ``replay`` pairs (run, its base)."""
  fix: str
  disa: str
  oracle: str
  contrasts: tuple[str, ...]
  controls: tuple[str, ...]
  compare: tuple[str, ...]
  replay: tuple[tuple[str, str], ...]


def build_claims(ev: Evidence, plan: Plan, stage1_abs_err: Mapping[str, Sequence[float]] | None
                 ) -> list[Claim]:
  """Every claim of the module docstring for the methods ``ev`` has, corrected (`finalise`). A
  pair of runs is compared once (its first declaration: a run that is both a reward maximiser
  and a control of the fix is tested once), so that no test enters the family twice."""
  have = lambda m: bool(m) and bool(ev.seed_rows.get(m))
  out = [stage1_claim(ev, stage1_abs_err)] if stage1_abs_err else []
  mains = [m for m in (plan.fix, plan.disa) if have(m)]
  if have(plan.oracle):
    out += [as_close_as_oracle(ev, m, plan.oracle) for m in mains if m != plan.oracle]
  pairs: list[tuple[str, str, bool, str | None]] = []
  for c in (x for x in plan.contrasts if have(x)):
    for m in mains:
      pairs.append((m, c, False, None))
      matched = matched_entropy(ev, m, c)
      out += [matched] if matched is not None else []
  pairs += [(plan.fix, c, False, f"{plan.fix}'s KL to the target is below its control {c}'s")
            for c in plan.controls if have(plan.fix) and have(c)]
  for i, pair in enumerate(plan.compare):
    a, b, two = parse_comparison(pair, f"compare[{i}]")
    pairs += [(a, b, two, None)] if have(a) and have(b) else []
  pairs += [(m, base, False, f"Stage 1 replay brings {base} closer to the target: {m}'s KL is "
                             f"below {base}'s") for m, base in plan.replay if have(m) and have(base)]
  seen: set[frozenset[str]] = set()
  for a, b, two, text in pairs:
    if frozenset((a, b)) not in seen:
      seen.add(frozenset((a, b)))
      out += kl_pair(ev, a, b, two, text)
  return finalise(out)
