"""benchmarks/bench_stage3_vs_trl.py's variant names: tree, allocator option, staleness."""
import importlib.util
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("bench_stage3_vs_trl",
                                               ROOT / "benchmarks" / "bench_stage3_vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


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
