"""The suite's scheduling hints (tests/conftest.py): every heavy group it names exists."""
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_heavy_group_names_an_existing_module_or_marked_group():
  for group in conftest.HEAVY:
    module, _, part = group.partition("::")
    path = ROOT / module
    assert path.is_file(), f"HEAVY names {module}, which does not exist"
    if part:  # a group of its own, declared by an xdist_group mark in that module
      text = path.read_text()
      assert "xdist_group" in text and f'"{part}"' in text, (group, "no such marked group")


def test_heavy_groups_are_listed_once():
  assert len(set(conftest.HEAVY)) == len(conftest.HEAVY)
