"""The import structure of `disa_jax` and `launch` (issue 28, item 5: imports at the top).

Read with `ast`, nothing is imported:

- no import of a project module (`disa_jax`, `configs`, `launch`, or a relative import) inside a
  function or method body: they sit at the top of their module, without exception (the generation
  process gets its environment when it is spawned, not by deferring JAX's import:
  `tests/rollout/test_process.py::test_the_generation_process_starts_with_its_env`);
- an import of a third-party module inside a function (an optional heavy dependency such as vllm
  or torch) says why, in a comment on its line or the line above;
- the package graph has no cycle. A node is the first path component under `disa_jax/` (`models`,
  `rl`, ...; a top-level module such as `disa_jax/config.py` is its own node), or `launch` /
  `configs`. Its arrows are the module-level imports; a function-local import of a project module
  (already a failure above) counts as well, so that a cycle it hides is reported too.
"""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("disa_jax", "launch")
PROJECT = ("disa_jax", "configs", "launch")


def _files():
  for top in SCANNED:
    yield from sorted((ROOT / top).rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _absolute(node: ast.ImportFrom, path: pathlib.Path) -> str:
  """The module an ImportFrom names, relative imports resolved."""
  if not node.level:
    return node.module or ""
  package = _module_name(path).split(".")
  if path.name != "__init__.py":
    package.pop()
  if node.level > 1:
    package = package[:len(package) - (node.level - 1)]
  return ".".join(package + ([node.module] if node.module else []))


def _imported(node, path):
  """The absolute module names an Import / ImportFrom statement brings in (for `from a import b`,
  both `a.b` and `a`: `b` may be a module or a name)."""
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  base = _absolute(node, path)
  return [f"{base}.{alias.name}" for alias in node.names] if base else []


def _is_project(name: str) -> bool:
  return name.split(".")[0] in PROJECT


def _imports(tree):
  """(import node, inside a function?) for every import statement in the tree."""
  found = []

  def visit(node, in_function):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        found.append((child, in_function))
      visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.Lambda)))

  visit(tree, False)
  return found


def _parsed():
  for path in _files():
    source = path.read_text()
    yield path, source.splitlines(), _imports(ast.parse(source, filename=str(path)))


def _where(path, node):
  return f"{path.relative_to(ROOT)}:{node.lineno}"


def test_no_function_local_project_imports():
  local = []
  for path, _, imports in _parsed():
    for node, in_function in imports:
      relative = isinstance(node, ast.ImportFrom) and node.level > 0
      if in_function and (relative or any(_is_project(n) for n in _imported(node, path))):
        local.append(_where(path, node))
  assert not local, (f"{len(local)} function-local imports of project modules (move them to the "
                     "top of the module):\n" + "\n".join(local))


# Tool directives are not reasons: `# pylint: disable=...`, `# noqa: ...`, `# type: ignore[...]`.
_DIRECTIVE = re.compile(r"pylint:\s*disable=\S+|noqa(:\s*[\w, ]+)?|type:\s*ignore(\[[^]]*\])?")


def _reason(line: str) -> str:
  """The words of the line's `#` comment, tool directives removed."""
  if "#" not in line:
    return ""
  return _DIRECTIVE.sub("", line.split("#", 1)[1]).replace("#", "").strip(" ()")


def _has_comment(lines, lineno):
  """A comment with a reason on the import's line, or a comment line right above it or above the
  run of import lines it belongs to."""
  if _reason(lines[lineno - 1]):
    return True
  i = lineno - 2
  while i >= 0 and lines[i].strip().startswith(("import ", "from ")):
    i -= 1
  return i >= 0 and lines[i].strip().startswith("#") and bool(_reason(lines[i]))


def test_function_local_third_party_imports_say_why():
  bare = []
  for path, lines, imports in _parsed():
    for node, in_function in imports:
      if in_function and not any(_is_project(n) for n in _imported(node, path)):
        if not _has_comment(lines, node.lineno):
          bare.append(f"{_where(path, node)}: {lines[node.lineno - 1].strip()}")
  assert not bare, ("function-local imports of third-party modules without a comment saying why "
                    "(e.g. `# optional heavy dependency: vllm`):\n" + "\n".join(bare))


def _package(module: str) -> str:
  """The graph node of a module: disa_jax.models.layers -> models, disa_jax.config -> config."""
  parts = module.split(".")
  if parts[0] != "disa_jax":
    return parts[0]
  return parts[1] if len(parts) > 1 else "disa_jax"


def _graph():
  """package -> {package it imports: [file:line, ...]} (`(in a function)` marks a function-local
  import)."""
  modules = {_module_name(path) for path in _files()}
  edges = {}
  for path, _, imports in _parsed():
    source = _package(_module_name(path))
    for node, in_function in imports:
      for name in _imported(node, path):
        if not _is_project(name):
          continue
        if isinstance(node, ast.ImportFrom) and name not in modules:
          name = name.rsplit(".", 1)[0]  # `from disa_jax.x import function`: the module is x
        target = _package(name)
        if target not in (source, "disa_jax"):
          where = _where(path, node) + (" (in a function)" if in_function else "")
          if where not in edges.setdefault(source, {}).setdefault(target, []):
            edges[source][target].append(where)
  return edges


def _cycles(edges):
  """The strongly connected components with more than one node (Tarjan)."""
  index, low, stack, on_stack, components = {}, {}, [], set(), []
  nodes = sorted(set(edges) | {t for targets in edges.values() for t in targets})

  def connect(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(edges.get(v, {})):
      if w not in index:
        connect(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        components.append(sorted(component))

  for v in nodes:
    if v not in index:
      connect(v)
  return components


def test_package_graph_has_no_cycle():
  edges = _graph()
  components = _cycles(edges)
  report = []
  for component in components:
    report.append("cycle among " + ", ".join(component) + ":")
    for source in component:
      for target in sorted(edges.get(source, {})):
        if target in component:
          report.append(f"  {source} -> {target}: " + ", ".join(edges[source][target]))
  assert not components, "package import cycles:\n" + "\n".join(report)


def test_graph_helpers():
  assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [
      ["a", "b", "c"]]
  assert _cycles({"a": {"b": []}, "b": {}}) == []
  assert _package("disa_jax.models.layers") == "models"
  assert _package("disa_jax.config") == "config"
  assert _package("launch.train") == "launch"
  assert not _reason("import vllm  # pylint: disable=g-import-not-at-top")
  assert _reason("import vllm  # pylint: disable=g-import-not-at-top  (optional: vllm)") == (
      "optional: vllm")
  assert _reason("import torch  # optional heavy dependency: torch") == (
      "optional heavy dependency: torch")
