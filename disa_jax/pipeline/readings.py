"""The declared readings of issue 63's on-policy block, read off its Holm-corrected tests.

docs/preregistration.md ("Baseline against coupling", Block 1) declared, before the runs, what the
block's tests would mean. On the training prompts' ``kl_auc``, in each clip arm (the runs
``<cell>_<arm>``), with d(A, B) the declared test of A - B and "shown" its Holm p < alpha within
the report's one family:

- *a baseline (variance) effect*: d(disa_exact, vargrad) shown, d(disa_exact, disa_exact_centred)
  shown with the same sign, and d(disa_exact_centred, vargrad) not shown;
- *more than the common baseline*: d(disa_exact, vargrad) and d(disa_exact_centred, vargrad) both
  shown with the same sign;
- *another pattern*: anything else, reported test by test ("not shown", never "no difference").

Across the arms, *survives without clipping*: d(disa_exact, vargrad) shown with the same sign in
every arm. `read` applies these rules to the section's `EndpointTest`s; nothing else enters.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from disa_jax.pipeline.report_records import EndpointTest

SET, ENDPOINT = "train", "kl_auc"
EXACT, CENTRED, VARGRAD = "disa_exact", "disa_exact_centred", "vargrad"
PAIRS = ((EXACT, VARGRAD), (EXACT, CENTRED), (CENTRED, VARGRAD))  # the three tests of an arm
BASELINE = "a baseline (variance) effect"
MORE = "more than the common baseline"
OTHER = "another pattern (read test by test)"


def arm_runs(arm: str) -> tuple[str, ...]:
  """The runs one clip arm's readings need."""
  return tuple(f"{cell}_{arm}" for cell in (EXACT, CENTRED, VARGRAD))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TestReading:
  """One declared test as a reading uses it: A - B, its difference and Holm p (None: not run),
  and ``sign`` +1 / -1 where shown (Holm p < alpha), 0 where not shown or not run."""
  a: str
  b: str
  diff: float | None
  p_holm: float | None
  sign: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArmReading:
  """A clip arm's three tests (`PAIRS`, in that order) and the declared reading they make."""
  arm: str
  tests: tuple[TestReading, ...]
  reading: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class Readings:
  """The report's ``readings`` (`read`): per arm its `ArmReading`, and whether d(disa_exact,
  vargrad) is shown with one sign in every arm (``survives_without_clipping``)."""
  set: str
  endpoint: str
  alpha: float
  arms: tuple[ArmReading, ...]
  survives_without_clipping: bool


def _find(tests: Sequence[EndpointTest], a: str, b: str) -> EndpointTest:
  for t in tests:
    if (t.a, t.b, t.set, t.endpoint) == (a, b, SET, ENDPOINT):
      return t
  raise ValueError(f"readings need the declared test {a} - {b} on the {SET} prompts' {ENDPOINT}; "
                   "the endpoints section has none")


def _reading(t: EndpointTest, alpha: float) -> TestReading:
  shown = t.p_holm is not None and t.diff is not None and t.p_holm < alpha and t.diff != 0
  return TestReading(a=t.a, b=t.b, diff=t.diff, p_holm=t.p_holm,
                     sign=(1 if t.diff > 0 else -1) if shown else 0)


def arm_reading(arm: str, tests: Sequence[EndpointTest], alpha: float) -> ArmReading:
  """The declared reading of clip arm ``arm`` (module docstring)."""
  ev, ec, cv = (_reading(_find(tests, f"{a}_{arm}", f"{b}_{arm}"), alpha) for a, b in PAIRS)
  if ev.sign and ec.sign == ev.sign and not cv.sign:
    reading = BASELINE
  elif ev.sign and cv.sign == ev.sign:
    reading = MORE
  else:
    reading = OTHER
  return ArmReading(arm=arm, tests=(ev, ec, cv), reading=reading)


def read(tests: Sequence[EndpointTest], arms: Sequence[str], alpha: float) -> Readings:
  """Every arm's reading, and whether d(disa_exact, vargrad) is shown with one sign in all."""
  got = tuple(arm_reading(arm, tests, alpha) for arm in arms)
  signs = {r.tests[0].sign for r in got}
  return Readings(set=SET, endpoint=ENDPOINT, alpha=alpha, arms=got,
                  survives_without_clipping=len(got) > 1 and len(signs) == 1 and 0 not in signs)


def _cell(t: TestReading) -> str:
  if t.diff is None or t.p_holm is None:
    return "not tested"
  word = {1: "A higher", -1: "A lower", 0: "not shown"}[t.sign]
  return f"{t.diff:+.3f}, Holm p {t.p_holm:.3g}: {word}"


def markdown(r: Readings | None) -> list[str]:
  """report.md's table of the declared readings (nothing when the preset declares none)."""
  if r is None:
    return []
  out = [f"### The declared readings ({r.set} prompts' {r.endpoint}; shown = Holm p < "
         f"{r.alpha:g} in the report's family)", "",
         "| arm | " + " | ".join(f"{a} - {b}" for a, b in PAIRS) + " | reading |",
         "|---|---|---|---|---|"]
  for arm in r.arms:
    out.append(f"| {arm.arm} | " + " | ".join(_cell(t) for t in arm.tests)
               + f" | {arm.reading} |")
  verdict = ("yes: shown with one sign in every arm" if r.survives_without_clipping else
             "not shown (d(disa_exact, vargrad) not shown with one sign in every arm)")
  return out + ["", f"Survives without clipping: {verdict}.", ""]
