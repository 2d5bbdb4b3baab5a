"""The scripts under benchmarks/ (a folder of scripts, not a package), imported by their tests."""
import importlib
import pathlib
import sys
import types

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> types.ModuleType:
  """``benchmarks/<name>.py`` imported as the module ``name``: registered in `sys.modules` (its
  dataclasses and pickles look themselves up there) with the folder on `sys.path` (scripts import
  one another, e.g. bench_gpu_train imports plan_memory)."""
  if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
  return importlib.import_module(name)
