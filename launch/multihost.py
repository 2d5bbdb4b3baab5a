r"""Runs an entry module inside a multi-process JAX run, or checks that the processes connect.

  # cluster smoke test: every process joins, an all-reduce over all devices is checked
  srun python launch/multihost.py --check
  # any entry point, after jax.distributed.initialize (same command on every host)
  srun python launch/multihost.py launch.sft --config=configs/sft_paper.py:qwen2.5-7b ...

The coordinator, process count and id come from the environment (SLURM, Cloud TPU, or
DISA_COORDINATOR / DISA_NUM_PROCESSES / DISA_PROCESS_ID; see `disa_jax.parallel.distributed`).
A missing or unknown entry module, or a malformed launch variable, is one ``error:`` line and exit
code 2 (`disa_jax.launcher.user_errors`); the entry module reports its own mistakes the same way.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
  sys.path.insert(0, _ROOT)

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # before JAX creates its CPU backend (a no-op on accelerators)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from disa_jax import launcher  # noqa: E402
from disa_jax.parallel import distributed  # noqa: E402

_STARTED = []  # the entry module runs: its errors are its own


def check() -> int:
  """Joins the run, sums one value per device over every device; returns a process exit code."""
  spec = distributed.initialize()
  devices = jax.devices()
  mesh = Mesh(np.asarray(devices), ("all",))
  sharding = NamedSharding(mesh, PartitionSpec("all"))
  # Device d contributes d + 1 (its global position), so the total is n (n + 1) / 2.
  local = np.asarray([devices.index(d) + 1.0 for d in jax.local_devices()], np.float32)
  x = jax.make_array_from_process_local_data(sharding, local, (len(devices),))
  total = float(jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, PartitionSpec()))(x))
  n = len(devices)
  ok = total == n * (n + 1) / 2
  print(f"process {jax.process_index()}/{jax.process_count()} launch={spec.source} "
        f"local_devices={len(jax.local_devices())} global_devices={n} all_reduce={total:g} "
        f"{'OK' if ok else 'WRONG'}", flush=True)
  distributed.sync_global("multihost_check")
  return 0 if ok else 1


def _entry_module(name: str) -> str:
  """``name`` if it is an importable module, else a ValueError naming it."""
  try:
    found = importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    found = False
  if not found or name.startswith("-"):
    raise ValueError(f"entry module {name!r} not found: give a module such as launch.train, "
                     "launch.sft or launch.stage1 (then its flags), or --check")
  return name


def main(argv: list[str]) -> int:
  if len(argv) > 1 and argv[1] in ("-h", "--help"):
    print(__doc__)
    return 0
  if len(argv) < 2:
    raise ValueError("missing the entry module: multihost.py launch.train --config=... "
                     "(or --check)")
  distributed.detect_launch()  # a malformed launch variable stops here, named
  if argv[1] == "--check":
    return check()
  module = _entry_module(argv[1])
  distributed.initialize()
  sys.argv = [module] + argv[2:]
  _STARTED.append(True)
  runpy.run_module(module, run_name="__main__", alter_sys=True)
  return 0


if __name__ == "__main__":
  with launcher.user_errors(sys.argv, started=lambda: bool(_STARTED)):
    sys.exit(main(sys.argv))
