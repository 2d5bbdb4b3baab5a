"""Function-call runner executed inside the sandbox (standard library only).

Reads `payload.json` from its working directory:
  {"program": str, "entry_point": str, "inputs": [[arg, ...], ...], "test": str | null}
executes the program in a fresh namespace (`__name__ != "__main__"`), calls the entry point on a
deep copy of every input, and writes ONE JSON document to the file descriptor that was stdout when
it started (the program's own prints go to /dev/null):
  {"load_error": str | null, "results": [["ok", <encoded value>] | ["err", <exception type>], ...],
   "check": true | false | null}
`check` is the outcome of the original HumanEval `check(candidate)` when `test` is given.

Values are encoded losslessly for comparison outside the sandbox (see `encode`): JSON for
None/bool/str/list/finite float/int, tagged objects for tuple, set, frozenset, dict, bytes, complex,
non-finite float, very large int, and `repr` for anything else. The grader never unpickles anything.
"""

import copy
import json
import math
import os

_MAX_DEPTH = 200


_BIG = 10 ** 300


def _plain_list(x):
  """Whether list `x` holds only str, bool, None, small ints and finite floats (JSON-exact)."""
  types = set(map(type, x))
  if not types <= {str, bool, type(None), int, float}:
    return False
  if float in types and not all(map(math.isfinite, (v for v in x if type(v) is float))):
    return False
  if int in types and not all(-_BIG < v < _BIG for v in x if type(v) is int):
    return False
  return True


def encode(x, depth=0):
  """Encodes a Python value as JSON-compatible data (see module docstring)."""
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply")
  t = type(x)
  if x is None or t is bool or t is str:
    return x
  if t is int:
    if -_BIG < x < _BIG:
      return x
    return {"__t": "bigint", "v": hex(x)}
  if t is float:
    if math.isfinite(x):
      return x
    return {"__t": "float", "v": repr(x)}
  if t is list:
    if _plain_list(x):  # fast path: long lists of plain scalars are JSON as they are
      return x
    return [encode(v, depth + 1) for v in x]
  if t is tuple:
    return {"__t": "tuple", "v": [encode(v, depth + 1) for v in x]}
  if t is set or t is frozenset:
    return {"__t": t.__name__, "v": [encode(v, depth + 1) for v in x]}
  if t is dict:
    items = [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in x.items()]
    return {"__t": "dict", "v": items}
  if t is bytes:
    return {"__t": "bytes", "v": x.hex()}
  if t is complex:
    return {"__t": "complex", "v": [encode(x.real, depth + 1), encode(x.imag, depth + 1)]}
  return {"__t": "repr", "v": f"{t.__module__}.{t.__qualname__}:{x!r}"[:10000]}


def main():
  out_fd = os.dup(1)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 1)
  with open("payload.json") as f:
    payload = json.load(f)
  doc = {"load_error": None, "results": [], "check": None}
  ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
  try:
    exec(compile(payload["program"], "candidate.py", "exec"), ns)  # pylint: disable=exec-used
    fn = ns[payload["entry_point"]]
  except BaseException as e:  # pylint: disable=broad-except
    doc["load_error"] = f"{type(e).__name__}: {e}"[:1000]
    fn = None
  if fn is not None:
    for args in payload["inputs"]:
      try:
        value = fn(*copy.deepcopy(args))
        doc["results"].append(["ok", encode(value)])
      except BaseException as e:  # pylint: disable=broad-except
        doc["results"].append(["err", type(e).__name__])
    if payload.get("test"):
      try:
        test_ns = {"__name__": "__check__", "__builtins__": __builtins__}
        test_ns.update({k: v for k, v in ns.items() if not k.startswith("__")})
        exec(compile(payload["test"], "test.py", "exec"), test_ns)  # pylint: disable=exec-used
        test_ns["check"](fn)
        doc["check"] = True
      except BaseException:  # pylint: disable=broad-except
        doc["check"] = False
  data = json.dumps(doc).encode()
  view = memoryview(data)
  while view:
    n = os.write(out_fd, view)
    view = view[n:]


if __name__ == "__main__":
  main()
