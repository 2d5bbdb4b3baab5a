"""Test-suite wide setup.

Eight fake CPU devices are requested before JAX is imported anywhere, so that sharding tests can build
meshes such as (data=2, fsdp=2, tensor=2) on this machine. Single-device tests are unaffected: arrays
land on device 0 unless a sharding says otherwise.
"""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def n_devices() -> int:
    return jax.device_count()
