"""benchmarks/bench_stage3_lockstep.py: the median's interval, the labels and the turn-taking."""
import json
import math
import os
import sys
import types

import numpy as np
import pytest

from disa_jax import rollout
from disa_jax.rl import trainer as trainer_mod
from tests.benchmarks.scripts import load

bench = load("bench_stage3_lockstep")


def _below(n: int, k: int) -> float:
  """P(Binomial(n, 1/2) <= k - 1)."""
  return sum(math.comb(n, i) for i in range(k)) / 2 ** n


@pytest.mark.parametrize("n", [6, 7, 20, 57, 147, 300])
def test_the_median_interval_is_the_narrowest_with_95_percent_coverage(n):
  xs = list(np.random.default_rng(n).normal(size=n))
  med, lo, hi = bench.median_interval(xs)
  s = sorted(xs)
  k = s.index(lo) + 1
  assert hi == s[n - k] and med == np.median(xs)
  assert 1 - 2 * _below(n, k) >= 0.95  # order statistics k and n + 1 - k cover the median
  assert 1 - 2 * _below(n, k + 1) < 0.95  # and k + 1 would not


def test_the_median_interval_covers_the_median_in_95_percent_of_draws():
  rng = np.random.default_rng(0)
  hits = [lo <= 0.0 <= hi for lo, hi in (bench.median_interval(list(rng.standard_t(3, 40)))[1:]
                                         for _ in range(2000))]
  assert 0.95 <= np.mean(hits) <= 0.985


def test_few_values_give_the_range_and_none_is_refused():
  assert bench.median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
  with pytest.raises(ValueError, match="no values"):
    bench.median_interval([])


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rounds_go_through_every_cyclic_order_so_each_variant_follows_each_other_equally(n):
  rounds = math.factorial(n - 1) * n
  follows = {}  # (variant, the one just before it in the ring) -> rounds
  for r in range(rounds):
    order = bench.ring_order(n, r)
    assert sorted(order) == list(range(n))
    for i, v in enumerate(order):
      follows[v, order[i - 1]] = follows.get((v, order[i - 1]), 0) + 1
  assert set(follows.values()) == {rounds // (n - 1)} and len(follows) == n * (n - 1)
  # and each variant runs first equally often
  assert sorted(bench.ring_order(n, r)[0] for r in range(rounds)) == sorted(list(range(n)) * (rounds // n))


def test_a_variant_named_again_gets_its_own_label():
  assert bench.label_variants(["new", "new", "git:54fbaa7", "new"]) == [
      "new", "new#2", "git:54fbaa7", "new#3"]


def test_rounds_compare_run_medians_after_compilation_where_both_logged():
  c = bench.COMPILE_STEPS
  a = [[{"t": 10.0}] * c + [{"t": 2.0}, {"t": 4.0}, {}], [{"t": 1.0}] * c + [{}]]
  b = [[{"t": 1.0}] * c + [{"t": 1.0}, {"t": 2.0}, {"t": 3.0}], [{"t": 1.0}] * c + [{"t": 1.0}]]
  assert bench.run_median(a[0], "t") == 3.0 and bench.run_median(a[1], "t") is None
  assert bench.round_ratios(a, b, "t") == [1.5]  # round 2: a logged nothing after compilation
  lines = bench.summarize(["x", "y"], {"x": a, "y": b})
  assert "    t" not in "".join(lines)  # not a phase: not reported
  rs = [[{"time/step_s": 2.0}] * (c + 1)] * 6
  lines = bench.summarize(["x", "y"], {"x": rs, "y": [[{"time/step_s": 1.0}] * (c + 1)] * 6})
  assert "step      2.000 [2.000, 2.000] (n=6; 2.00 2.00 2.00 2.00 2.00 2.00)" in "\n".join(lines)


def test_sittings_are_pooled_round_by_round_and_other_designs_refused(tmp_path, monkeypatch,
                                                                      capsys):
  c = bench.COMPILE_STEPS
  run = lambda t: [{"time/step_s": t}] * (c + 1)
  one, two, other = tmp_path / "1.json", tmp_path / "2.json", tmp_path / "3.json"
  one.write_text(json.dumps({"runs": {"new": [run(2.0)] * 3, "git:x": [run(1.0)] * 3}}))
  two.write_text(json.dumps({"runs": {"new": [run(3.0)] * 3, "git:x": [run(1.0)] * 3}}))
  other.write_text(json.dumps({"runs": {"new": [run(3.0)], "git:y": [run(1.0)]}}))
  labels, runs = bench.pool([str(one), str(two)])
  assert labels == ["new", "git:x"] and len(runs["new"]) == 6
  assert bench.round_ratios(runs["new"], runs["git:x"], "time/step_s") == [2.0] * 3 + [3.0] * 3
  with pytest.raises(ValueError, match=r"3.json: variants \['new', 'git:y'\] differ from .*1.json"):
    bench.pool([str(one), str(other)])
  monkeypatch.setattr(sys, "argv", ["bench", "--pool", str(one), str(two)])
  bench.main()
  out = capsys.readouterr().out
  assert "6 rounds pooled" in out and "(n=6; 2.00 2.00 2.00 3.00 3.00 3.00)" in out
  monkeypatch.setattr(sys, "argv", ["bench", "--pool", str(one), str(other)])
  with pytest.raises(SystemExit, match="--pool: .*3.json: variants"):
    bench.main()


def test_steps_wait_for_the_token_and_pass_it_on(monkeypatch):
  """A ring of one: each step takes the token its previous step passed on; the engine's split
  of the generate phase joins the step's metrics; without the token a step stops with a
  TimeoutError naming the ring."""
  calls = []
  engine = types.SimpleNamespace(last_generate={"engine_s": 0.015, "total_s": 0.02})
  monkeypatch.setattr(trainer_mod.Trainer, "step", lambda self, k: calls.append(k) or {
      "time/generate_s": 0.02})
  monkeypatch.setattr(rollout, "make_engine", lambda *a, **k: engine)
  r, w = os.pipe()
  try:
    release = bench.take_turns(r, w, timeout_s=0.2)
    assert rollout.make_engine("jax", "dir") is engine
    os.write(w, bench.TOKEN)
    for k in range(3):
      m = trainer_mod.Trainer.step(None, k)
    assert calls == [0, 1, 2]
    assert m["time/engine_s"] == 0.015 and m["time/transport_s"] == pytest.approx(0.005)
    release()
    assert os.read(r, 8) == bench.TOKEN  # one token, passed on for good
    release()  # not held any more: nothing written
    with pytest.raises(TimeoutError, match="another variant of the ring stopped"):
      trainer_mod.Trainer.step(None, 3)
    assert calls == [0, 1, 2]
  finally:
    os.close(r)
    os.close(w)
