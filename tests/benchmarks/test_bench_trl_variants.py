"""benchmarks/bench_stage3_vs_trl.py's variant names: tree, allocator option, staleness."""
import re

import pytest

from tests.benchmarks.scripts import load

bench = load("bench_stage3_vs_trl")


@pytest.mark.parametrize("name,want", [
    ("new", ("new", "", 0)), ("new@k1", ("new", "", 1)), ("base+malloc", ("base", "+malloc", 0)),
    ("new+nomalloc@k2", ("new", "+nomalloc", 2)), ("git:54fbaa7", ("git:54fbaa7", "", 0)),
    ("new+dense", ("new", "+dense", 0)), ("new+ragged", ("new", "+ragged", 0))])
def test_variants_name_their_tree_allocator_and_staleness(name, want):
  assert bench.parse_variant(name) == want


@pytest.mark.parametrize("name", ["old", "new+fast", "new@kx", "new@k-1", "new@1", "git:"])
def test_unknown_variants_are_refused_by_name(name):
  with pytest.raises(ValueError, match=re.escape(f"unknown variant {name!r}")):
    bench.parse_variant(name)
