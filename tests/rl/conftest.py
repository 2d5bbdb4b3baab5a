"""Stage 3 tests: a session-local persistent compilation cache.

The trainer and train-step tests build several trainers with identical jitted programs (fresh
closures, so JAX's in-memory cache misses); a compilation cache in a per-session temporary
directory lets them share compiled executables within one pytest run, and nothing persists.
"""
import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def _session_compilation_cache(tmp_path_factory):
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs,
         jax.config.jax_persistent_cache_min_entry_size_bytes)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield
  jax.config.update("jax_compilation_cache_dir", old[0])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", old[2])
