"""`disa_jax.tasks.registry` (issue 64, item 4): the one plugin loader, which every workflow that
reads ``reward_plugins`` imports from there, not from another workflow."""
import ast
from pathlib import Path

import pytest

from disa_jax import rewards
from disa_jax.tasks import registry

ROOT = Path(__file__).resolve().parents[2]


def test_a_plugin_registers_its_task_and_a_missing_one_is_named():
  registry.import_reward_plugins(["tests.workflows.toy_reward"])
  assert "toy_contains" in registry.task_names()
  assert registry.get_task("toy_contains").reward_fn()(["a b"], [{"ground_truth": "b"}]).reward.shape == (1,)
  with pytest.raises(ValueError, match=r"^reward_plugins: cannot import 'no_such_plugin_mod': "):
    registry.import_reward_plugins(["no_such_plugin_mod"])


def test_workflows_import_the_plugin_loader_from_the_task_registry_only():
  """No workflow module defines a plugin loader or imports one from another workflow module."""
  found = {}
  for path in sorted((ROOT / "disa_jax" / "workflows").glob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef) and "plugin" in node.name:
        found[path.name] = f"defines {node.name}"
      if isinstance(node, ast.ImportFrom) and any("plugin" in a.name for a in node.names):
        if node.module != "disa_jax.tasks.registry":
          found[path.name] = f"imports it from {node.module}"
  assert not found, found
  uses = [p.name for p in (ROOT / "disa_jax" / "workflows").glob("*.py")
          if "import_reward_plugins(" in p.read_text()]
  assert sorted(uses) == ["evaluation.py", "stage1.py", "stage3.py"]
  assert rewards.reward_names() == registry.task_names()
