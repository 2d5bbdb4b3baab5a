"""The analysis notebooks run top to bottom (they carry their own assertions)."""
import os
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.parametrize("name", ["estimator_bias.ipynb"])
def test_notebook_executes(name, tmp_path):
  nb = nbformat.read(NOTEBOOKS / name, as_version=4)
  env_flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = env_flags.replace("--xla_force_host_platform_device_count=8", "").strip()
  t0 = time.time()
  try:
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
  finally:
    os.environ["XLA_FLAGS"] = env_flags
  assert time.time() - t0 < 120
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
  assert not errors
