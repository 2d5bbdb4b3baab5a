"""`disa_jax.runtime.tune_host_allocator`: the three mallopt settings on CPU runs, nothing elsewhere."""
import ctypes.util
import os
import subprocess
import sys

import pytest

from disa_jax import runtime


class FakeLibc:
  def __init__(self, refuse=()):
    self.calls, self.refuse = [], set(refuse)

  def mallopt(self, param, value):
    self.calls.append((param, value))
    return 0 if param in self.refuse else 1


@pytest.mark.parametrize("platforms,expected", [("cpu", True), ("CPU,cuda", True), ("cuda", False),
                                                ("tpu,cpu", False)])
def test_jax_platforms_decides_the_backend(monkeypatch, platforms, expected):
  monkeypatch.setenv("JAX_PLATFORMS", platforms)
  assert runtime.runs_on_cpu() is expected


def test_without_jax_platforms_an_installed_accelerator_plugin_means_no_cpu(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(runtime.importlib.util, "find_spec",
                      lambda name: object() if name == "jax_cuda12_plugin" else None)
  assert not runtime.runs_on_cpu()
  monkeypatch.setattr(runtime.importlib.util, "find_spec", lambda name: None)
  assert runtime.runs_on_cpu()


def test_cpu_runs_get_one_arena_no_mmap_and_no_trimming(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("DISA_HOST_MALLOC", raising=False)
  libc = FakeLibc()
  assert runtime.tune_host_allocator(libc=libc)
  assert libc.calls == [(-8, 1), (-4, 0), (-1, -1)]  # M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD


@pytest.mark.parametrize("env", [{"JAX_PLATFORMS": "cuda"}, {"JAX_PLATFORMS": "cpu", "DISA_HOST_MALLOC": "0"}])
def test_accelerator_runs_and_the_opt_out_leave_the_allocator_alone(monkeypatch, env):
  monkeypatch.delenv("DISA_HOST_MALLOC", raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  libc = FakeLibc()
  assert not runtime.tune_host_allocator(libc=libc) and libc.calls == []


def test_a_refused_setting_is_an_error_naming_it(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("DISA_HOST_MALLOC", raising=False)
  with pytest.raises(OSError, match=r"mallopt\(-4, 0\) failed"):
    runtime.tune_host_allocator(libc=FakeLibc(refuse={-4}))


_REUSE = """
import ctypes, ctypes.util, resource
from disa_jax import runtime
libc = ctypes.CDLL(ctypes.util.find_library("c"))
for param, value in runtime.SETTINGS:
  assert libc.mallopt(param, value) == 1, (param, value)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n = 1200 << 20  # larger than the 1 GiB trim threshold this replaced
faults = []
for _ in range(2):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = libc.malloc(n)
  ctypes.memset(block, 1, n)
  libc.free(block)
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not ctypes.util.find_library("c"),
                    reason="glibc's mallopt")
def test_under_the_settings_a_freed_block_of_over_a_gib_is_reused_without_page_faults():
  """XLA:CPU's per-execution scratch of a d=512 train step is several GiB. Under `SETTINGS` the
  second malloc of a freed 1.2 GiB block gets the same, already mapped pages (with a 1 GiB trim
  threshold glibc gave them back to the kernel on free, and each step faulted them in again)."""
  out = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True, check=True)
  first, second = map(int, out.stdout.split())
  assert first > 250_000  # 1.2 GiB of 4 KiB pages, faulted in on first touch
  assert second < first // 100, (first, second)


def test_the_persistent_compilation_cache_reaches_this_process_and_its_children(monkeypatch,
                                                                                 tmp_path):
  """`persistent_compilation_cache`: JAX's options in this process, the environment for the
  processes it starts (a fresh interpreter compiles into the directory), and a cache directory
  already in the environment wins."""
  import jax  # (as the function does: after the allocator's settings)
  saved = {name: getattr(jax.config, name) for name, _ in runtime.CACHE_ENV.values()}
  for env in runtime.CACHE_ENV:
    monkeypatch.delenv(env, raising=False)
  try:
    got = runtime.persistent_compilation_cache(tmp_path / "cache")
    assert got == str(tmp_path / "cache") == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_compilation_cache_dir == got
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
    child = subprocess.run(
        [sys.executable, "-c", "import jax, jax.numpy as jnp; "
         "print(jax.jit(lambda x: x * 3 + 1)(jnp.arange(4.0)).sum())"],
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "22.0"
    assert any((tmp_path / "cache").iterdir())  # the child's program, cached
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "theirs"))
    assert runtime.persistent_compilation_cache(tmp_path / "mine") == str(tmp_path / "theirs")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)


def test_the_host_description_names_the_cpu_model_and_cores(monkeypatch, tmp_path):
  """What the benchmarks record as their machine: the first 'model name' of /proc/cpuinfo."""
  info = tmp_path / "cpuinfo"
  info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nprocessor\t: 1\n"
                  "model name\t: Test CPU 9000\n")
  real_open, real_exists = open, runtime.os.path.exists
  monkeypatch.setattr(runtime.os.path, "exists",
                      lambda p: True if p == "/proc/cpuinfo" else real_exists(p))
  monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(
      info if p == "/proc/cpuinfo" else p, *a, **k))
  monkeypatch.setattr(runtime.os, "cpu_count", lambda: 2)
  assert runtime.host_description() == "Test CPU 9000, 2 cores"
  assert runtime.load_average() >= 0.0
