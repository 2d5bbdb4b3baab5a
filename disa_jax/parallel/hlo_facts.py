"""Facts read from an optimized XLA module's text (`compiled.as_text()`), without running it.

XLA's own cost analysis counts a while loop's body once. `read_module` parses the module into its
computations and instructions, works out how often each computation runs per call of the entry
(a while body: the loop's ``known_trip_count`` times its caller's count; a fusion or a called
computation: as often as its caller), and from that reports per program run:

- ``dot_flops``: 2 x output elements x contracted elements of every ``dot`` (in fusions too) and
  cuBLAS GEMM custom call, each weighted by how often it runs;
- the largest arrays that exist as buffers (results of instructions outside fusion bodies);
- custom calls (cuDNN attention, Triton / Pallas kernels) and the custom fusion kinds (Triton
  GEMMs), with counts per run;
- collectives (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute) with their
  result bytes per run;
- while loops, with their trip count, or None where XLA found none (the count depends on device
  data: a host-visible loop bound);
- the segment slots of the cuDNN attention calls (the second dimension of their int32
  ``[B, M]`` sequence-length operand).
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Iterator

_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)="
                    r"%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
CUDNN_ATTENTION = "__cudnn$fmha"


@dataclasses.dataclass(frozen=True)
class Array:
  """One array shape: element type and dimensions."""
  dtype: str
  dims: tuple[int, ...]

  @property
  def elements(self) -> int:
    return math.prod(self.dims)

  @property
  def bytes(self) -> int:
    return self.elements * _DTYPE_BYTES.get(self.dtype, 4)

  def __str__(self) -> str:
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  shapes: tuple[Array, ...]  # the result (a tuple's elements in order)
  operands: tuple[str, ...]
  attrs: str  # everything after the operand list


@dataclasses.dataclass(frozen=True)
class Buffer:
  """A large array the program holds: its shape and the instruction that makes it."""
  shape: str
  bytes: int
  elements: int
  op: str
  source: str  # the JAX operation it comes from (the metadata's op_name), or ''


@dataclasses.dataclass(frozen=True)
class WhileLoop:
  name: str
  trip_count: int | None  # None: XLA found no static count (it depends on device data)
  runs: int  # how often the loop itself runs per program run


@dataclasses.dataclass(frozen=True)
class ModuleFacts:
  """What `read_module` found (counts and bytes per run of the program)."""
  dot_flops: int
  largest: tuple[Buffer, ...]
  custom_calls: dict[str, int]
  kernel_fusions: dict[str, int]
  collectives: dict[str, dict[str, int]]  # kind -> {"count": n, "bytes": b}
  while_loops: tuple[WhileLoop, ...]
  cudnn_segment_slots: tuple[int, ...]

  @property
  def data_dependent_loops(self) -> tuple[WhileLoop, ...]:
    return tuple(w for w in self.while_loops if w.trip_count is None)


def _arrays(text: str) -> tuple[Array, ...]:
  return tuple(Array(d, tuple(int(x) for x in s.split(",") if x))
               for d, s in _ARRAY.findall(text) if d in _DTYPE_BYTES)


def _split_operands(rest: str) -> tuple[str, str]:
  """``'a, %b), attr=...'`` -> (operand text, attribute text), at the matching parenthesis."""
  depth = 1
  for i, ch in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


def parse_computations(text: str) -> dict[str, tuple[bool, list[Instruction]]]:
  """``{computation: (is_entry, instructions)}`` of an HLO module's text."""
  comps: dict[str, tuple[bool, list[Instruction]]] = {}
  current: list[Instruction] | None = None
  for line in text.splitlines():
    head = _HEADER.match(line)
    if head and not line.startswith(" "):
      current = []
      comps[head.group(2)] = (bool(head.group(1)), current)
      continue
    m = _INSTR.match(line)
    if m is None or current is None:
      continue
    _, name, shape, opcode, rest = m.groups()
    operands, attrs = _split_operands(rest)
    current.append(Instruction(name, opcode, _arrays(shape),
                               tuple(re.findall(r"%([\w.\-]+)", operands)), attrs))
  return comps


def _callees(ins: Instruction) -> Iterator[tuple[str, str]]:
  for kind, comp in _CALLS.findall(ins.attrs):
    yield kind, comp
  for group in _BRANCHES.findall(ins.attrs):
    for comp in re.findall(r"%([\w.\-]+)", group):
      yield "branch", comp


def _trip_count(ins: Instruction) -> int | None:
  m = _TRIP.search(ins.attrs)
  return int(m.group(1)) if m else None


def run_counts(comps: dict[str, tuple[bool, list[Instruction]]]) -> dict[str, int]:
  """How often each computation runs per program run (while bodies x their trip count; a loop
  without a known count is counted once). Reduction bodies (``to_apply``) get 0: they are
  per-element scalar code."""
  edges: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
  for caller, (_, instrs) in comps.items():
    for ins in instrs:
      for kind, callee in _callees(ins):
        factor = 0 if kind == "to_apply" else 1
        if kind == "body":
          factor = _trip_count(ins) or 1
        edges[callee].append((caller, factor))
  memo: dict[str, int] = {c: 1 for c, (entry, _) in comps.items() if entry}

  def count(comp: str) -> int:
    if comp not in memo:
      memo[comp] = 0  # a cycle cannot occur in HLO; this only guards the recursion
      memo[comp] = sum(count(caller) * f for caller, f in edges.get(comp, ()))
    return memo[comp]

  return {c: count(c) for c in comps}


def _dot_flops(ins: Instruction, shapes: dict[str, Array]) -> int:
  """2 x output elements x contracted elements of a dot or cuBLAS GEMM; 0 for anything else."""
  if ins.opcode == "dot":
    dims = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
  elif ins.opcode == "custom-call" and "__cublas$" in ins.attrs and "gemm" in ins.attrs.lower():
    dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
  else:
    return 0
  lhs = shapes.get(ins.operands[0]) if ins.operands else None
  if dims is None or lhs is None or not ins.shapes:
    return 0
  contracted = math.prod(lhs.dims[int(d.strip('" '))] for d in dims.group(1).split(",") if d)
  return 2 * ins.shapes[0].elements * contracted


def _fusion_kind(ins: Instruction) -> str | None:
  m = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', ins.attrs)
  if m is None or not any(k in m.group(1) for k in ("triton", "cudnn")):
    return None
  return m.group(1)


def _custom_target(ins: Instruction) -> str:
  m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
  return m.group(1) if m else "?"


def _segment_slots(ins: Instruction, shapes: dict[str, Array]) -> int | None:
  ints = [shapes[o] for o in ins.operands if o in shapes and shapes[o].dtype == "s32"
          and len(shapes[o].dims) == 2]
  return min(a.dims[1] for a in ints) if ints else None


def read_module(text: str, *, top: int = 8) -> ModuleFacts:
  """The `ModuleFacts` of an optimized module's text (see the module docstring)."""
  comps = parse_computations(text)
  runs = run_counts(comps)
  shapes = {i.name: i.shapes[0] for _, instrs in comps.values() for i in instrs
            if len(i.shapes) == 1}
  fused = {c for _, instrs in comps.values() for i in instrs if i.opcode == "fusion"
           for k, c in _callees(i) if k == "calls"}
  flops, customs, fusions = 0, collections.Counter(), collections.Counter()
  colls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
  buffers: dict[str, Buffer] = {}
  loops, slots = [], set()
  for comp, (_, instrs) in comps.items():
    n = runs[comp]
    for ins in instrs:
      flops += n * _dot_flops(ins, shapes)
      if ins.opcode == "custom-call":
        target = _custom_target(ins)
        customs[target] += n
        if target.startswith(CUDNN_ATTENTION) and "Backward" not in target:
          s = _segment_slots(ins, shapes)
          if s is not None:
            slots.add(s)
      elif ins.opcode == "fusion" and _fusion_kind(ins):
        fusions[_fusion_kind(ins)] += n
      elif ins.opcode == "while":
        loops.append(WhileLoop(ins.name, _trip_count(ins), n))
      kind = next((c for c in COLLECTIVES if ins.opcode in (c, c + "-start")), None)
      if kind:
        colls[kind]["count"] += n
        colls[kind]["bytes"] += n * max((a.bytes for a in ins.shapes), default=0)
      if comp not in fused:
        for a in ins.shapes:
          key = str(a)
          if key not in buffers or len(ins.name) < len(buffers[key].op):
            source = re.search(r'op_name="([^"]*)"', ins.attrs)
            buffers[key] = Buffer(key, a.bytes, a.elements, ins.name,
                                  source.group(1) if source else "")
  largest = tuple(sorted(buffers.values(), key=lambda b: -b.bytes)[:top])
  return ModuleFacts(int(flops), largest, dict(customs), dict(fusions),
                     {k: dict(v) for k, v in colls.items()}, tuple(loops), tuple(sorted(slots)))

