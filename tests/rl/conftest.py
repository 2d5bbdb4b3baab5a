"""Fixtures shared by the Stage 3 tests."""
import jax
import pytest


@pytest.fixture()
def default_xla_optimizations():
  """XLA's default optimizations for this test (the suite compiles without most of them,
  tests/conftest.py): a golden file is compared with programs built as when it was written."""
  was = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", was)
