"""`disa_jax.runtime.tune_host_allocator`: the three mallopt settings on CPU runs, nothing elsewhere."""
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


def test_cpu_runs_get_one_arena_no_mmap_and_a_high_trim_threshold(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("DISA_HOST_MALLOC", raising=False)
  libc = FakeLibc()
  assert runtime.tune_host_allocator(libc=libc)
  assert libc.calls == [(-8, 1), (-4, 0), (-1, 1 << 30)]  # M_ARENA_MAX, M_MMAP_MAX, M_TRIM_THRESHOLD


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
