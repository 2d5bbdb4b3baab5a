"""Process setup for runs on CPU: glibc's allocator keeps XLA's scratch memory between executions.

XLA:CPU allocates each execution's temporaries as one block (64.5 MiB for the Stage 3 update of the
main job's tiny model). glibc serves a block that large from a fresh ``mmap`` when the request comes
from one of XLA's worker threads (their arenas are 64 MiB heaps), and returns it on free, so every
call faults every page in again: 16.5k minor faults per update, most of the backward's apparent cost
(issue 14's profile, `benchmarks/profile_train_step.py`). With one arena (``M_ARENA_MAX`` = 1), no
mmapped blocks (``M_MMAP_MAX`` = 0) and no trimming of the heap's top (``M_TRIM_THRESHOLD`` = -1,
which mallopt(3) documents as "disables trimming completely"), the block is reused: 30 faults per
update, the train phase 0.197 -> 0.114 s on that model. A finite threshold is not enough for larger
models: the d=512 train step's temporaries span several GiB, and with a 1 GiB threshold (the largest
a C int allows is 2 GiB) every step gave ~570k minor faults and took 6.3 s for forward + backward
against 5.2 s and 0 faults untrimmed (one measurement). The price is that the process keeps its
peak heap until it exits.

`tune_host_allocator` applies those three settings through ``mallopt``. It must run before JAX
creates its backend (before the first array or jit), so the launch entry points and the test suite's
conftest call it first. It does nothing on an accelerator (the scratch lives in device memory),
without glibc, or with ``DISA_HOST_MALLOC=0``.

`persistent_compilation_cache` points JAX's compilation cache at a directory for a process and the
processes it starts: a job that runs many processes of the same shapes (the main job's Stage 3
runs, each with its generation process) compiles each program once.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os
import statistics
from typing import Any

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
M_ARENA_MAX = -8
SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                       "jax_rocm7_plugin", "libtpu")


def runs_on_cpu() -> bool:
  """Whether JAX will pick the CPU backend, decided without creating a backend.

  ``JAX_PLATFORMS`` decides when set (its first entry); otherwise JAX picks an accelerator whenever
  one of its plugins is installed.
  """
  platforms = os.environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip().lower() == "cpu"
  return not any(importlib.util.find_spec(m) is not None for m in ACCELERATOR_PLUGINS)


def tune_host_allocator(*, libc: Any = None) -> bool:
  """Applies `SETTINGS` with ``mallopt`` on a CPU run (see the module docstring).

  Args:
    libc: the C library to call (tests pass a fake); default: the process's glibc.

  Returns:
    Whether the settings were applied (False: an accelerator run, ``DISA_HOST_MALLOC=0``, or a C
    library without ``mallopt``).

  Raises:
    OSError: ``mallopt`` refused a setting (names it).
  """
  if os.environ.get("DISA_HOST_MALLOC", "1") == "0" or not runs_on_cpu():
    return False
  if libc is None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
  if libc is None or not hasattr(libc, "mallopt"):
    return False
  for param, value in SETTINGS:
    if libc.mallopt(param, value) != 1:
      raise OSError(f"mallopt({param}, {value}) failed: the allocator refused the setting")
  return True


# environment variable -> (JAX's config option, its type)
CACHE_ENV = {"JAX_COMPILATION_CACHE_DIR": ("jax_compilation_cache_dir", str),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS":
                 ("jax_persistent_cache_min_compile_time_secs", float),
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES":
                 ("jax_persistent_cache_min_entry_size_bytes", int)}


def persistent_compilation_cache(directory: str | os.PathLike) -> str:
  """Caches every compiled program in ``directory`` (JAX's persistent compilation cache, with no
  minimum compile time or size), in this process and, through the environment, in the processes it
  starts (their JAX reads ``JAX_COMPILATION_CACHE_DIR`` and the two minimums when imported).

  A cache directory already in the environment wins (a test session's, a user's). An entry is
  keyed by the program, its compile options, the JAX / XLA versions and the device, so a hit is the
  program that compiling would give: results are unchanged.

  Returns:
    The cache directory in use.
  """
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.fspath(directory))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  # (imported here: `tune_host_allocator` runs before anything imports JAX)
  import jax  # pylint: disable=g-import-not-at-top
  for env, (name, kind) in CACHE_ENV.items():
    value = kind(os.environ[env])
    if getattr(jax.config, name) != value:
      jax.config.update(name, value)
  return os.environ["JAX_COMPILATION_CACHE_DIR"]


def host_description() -> str:
  """The CPU model and core count (``/proc/cpuinfo``), as the benchmarks record their machine."""
  info = ""
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      info = f.read()
  model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                if line.startswith("model name")), "?")
  return f"{model}, {os.cpu_count()} cores"


def load_average() -> float:
  """The 1-minute load average (what the benchmarks quote beside each timing)."""
  return os.getloadavg()[0]


def spread(xs: Any) -> dict[str, float]:
  """Median, min and max of repeated timings (how the benchmarks summarise their blocks)."""
  xs = sorted(float(x) for x in xs)
  return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1]}
