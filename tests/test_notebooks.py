"""The analysis notebooks: one parameter cell (a run directory), inline figures, no errors.

`execute_on_run` runs a notebook top to bottom on a run directory (the main job's test run builds
one: `tests/test_main_job.py::test_notebooks_open_the_run`) and checks that every cell tagged
'figure' rendered at least one non-blank PNG inline, as Jupyter would show it.
"""
from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from PIL import Image

NOTEBOOKS_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ("estimator_bias.ipynb", "anchor.ipynb", "dynamics.ipynb")
DEFAULT_RUN_DIR = '"/tmp/disa_main"'  # the README's main-job workdir


def _parameter_cell(nb) -> int:
  cells = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(cells) == 1, f"expected one cell tagged 'parameters', found {len(cells)}"
  return cells[0]


def _pngs(cell) -> list[np.ndarray]:
  out = []
  for o in cell.get("outputs", []):
    data = o.get("data", {}) if o.output_type in ("display_data", "execute_result") else {}
    if "image/png" in data:
      out.append(np.asarray(Image.open(io.BytesIO(base64.b64decode(data["image/png"])))))
  return out


def execute_on_run(path: str | os.PathLike, run_dir: str | os.PathLike, cwd: str | os.PathLike):
  """Executes the notebook at ``path`` with ``RUN_DIR = run_dir``; returns it executed."""
  name = Path(path).name
  nb = nbformat.read(path, as_version=4)
  nb.cells[_parameter_cell(nb)].source = f"RUN_DIR = {json.dumps(str(run_dir))}\n"
  env_flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = env_flags.replace("--xla_force_host_platform_device_count=8", "").strip()
  try:
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
  finally:
    os.environ["XLA_FLAGS"] = env_flags
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.output_type == "error"]
  assert not errors, errors
  for i, cell in enumerate(nb.cells):
    if "figure" not in cell.metadata.get("tags", []):
      continue
    images = _pngs(cell)
    assert images, f"{name} cell {i} drew no inline figure:\n{cell.source[:300]}"
    for img in images:
      assert img.shape[0] > 50 and img.shape[1] > 50, (name, i, img.shape)
      assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 8, f"{name} cell {i}: blank"
  return nb


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_take_one_path_and_render_inline(name):
  nb = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
  param = nb.cells[_parameter_cell(nb)].source
  assert f"RUN_DIR = {DEFAULT_RUN_DIR}" in param  # defaults to the main job's output
  code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
  assert "matplotlib.use(" not in code  # an Agg override suppresses every figure in Jupyter
  assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")  # committed clean
  assert any("figure" in c.metadata.get("tags", []) for c in nb.cells)


def test_the_figure_check_fails_on_a_notebook_without_its_figure(tmp_path):
  """The checker itself: a tagged cell that draws nothing, or draws a blank canvas, fails."""
  nb = nbformat.v4.new_notebook(cells=[
      nbformat.v4.new_code_cell('RUN_DIR = "x"', metadata={"tags": ["parameters"]}),
      nbformat.v4.new_code_cell("import matplotlib.pyplot as plt\nfig, ax = plt.subplots()\n"
                                "ax.axis('off')\nplt.show()", metadata={"tags": ["figure"]})])
  nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
  nbformat.write(nb, tmp_path / "blank.ipynb")
  with pytest.raises(AssertionError, match="blank"):
    execute_on_run(tmp_path / "blank.ipynb", tmp_path, tmp_path)
  nb.cells[1].source = "print('no figure')"
  nbformat.write(nb, tmp_path / "none.ipynb")
  with pytest.raises(AssertionError, match="drew no inline figure"):
    execute_on_run(tmp_path / "none.ipynb", tmp_path, tmp_path)


def test_the_kl_strip_has_one_legend_titles_in_words_and_a_labelled_target(tmp_path, monkeypatch):
  """dynamics.ipynb's figure of KL(π‖π̃), its decomposition and the entropy over correct answers
  (five panels), drawn from two made-up runs by the notebook's own cells: one legend for the
  figure (every run once, then the target line), panel titles in words, the target labelled."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (the notebooks' own)
  keys = ("kl_mc", "kl_mc_se", "kl_binary", "p_correct_kl_correct", "p_wrong_kl_wrong",
          "entropy_correct", "target_entropy_correct", "p_correct")
  for run, scale in (("disa", 1.0), ("grpo", 2.0)):
    (tmp_path / "stage3" / run).mkdir(parents=True)
    rows = [{"step": s, "reward": 0.1 * s, **{f"exact/{k}": scale * (1 + s) for k in keys}}
            for s in range(4)]
    (tmp_path / "stage3" / run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows))
  nb = nbformat.read(NOTEBOOKS_DIR / "dynamics.ipynb", as_version=4)
  cells = [c for c in nb.cells if c.cell_type == "code"]
  setup = next(c for c in cells if "def series" in c.source)
  strip = next(c for c in cells if "exact/kl_mc_se" in c.source)
  monkeypatch.setattr(plt, "show", lambda *a, **k: None)
  namespace = {"RUN_DIR": str(tmp_path)}
  exec(setup.source, namespace)  # pylint: disable=exec-used
  exec(strip.source, namespace)  # pylint: disable=exec-used
  fig = namespace["fig"]
  try:
    assert len(fig.axes) == 5
    assert len(fig.legends) == 1 and all(ax.get_legend() is None for ax in fig.axes)
    titles = [ax.get_title() for ax in fig.axes]
    assert all(t and "_" not in t and "/" not in t for t in titles), titles  # words, not keys
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:2] == ["disa", "grpo"] and len(labels) == 3, labels
    target = [l for l in fig.axes[-1].get_lines() if l.get_label() == labels[2]]
    assert labels[2].startswith("target") and target, labels  # the dashed line, named
  finally:
    plt.close(fig)
