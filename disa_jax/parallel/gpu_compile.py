"""XLA:GPU programs compiled on a machine without a GPU (deviceless ahead-of-time compilation).

A card description (`gpu_cards/<name>.txtpb`, an XLA ``GpuTargetConfigProto``) and a topology
string ``partitions x hosts x devices`` ('1x1x1' one GPU, '1x1x8' one 8-GPU host, '1x2x8' two)
give `jax.experimental.topologies` abstract CUDA devices; a jitted function lowered on abstract
inputs placed on them (`jax.ShapeDtypeStruct` with shardings of a mesh over `topology_devices`)
compiles to the program a real card would run, which nothing here executes. `compile_report`
reads it into a `ProgramReport`: compile seconds; per-device argument / output / alias / temp
bytes and their total against the card's memory; FLOPs; the largest buffers, custom calls
(cuDNN attention, Triton / Pallas kernels), collectives and while loops (`hlo_facts`).

This needs JAX's CUDA plugin (``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` of the installed JAX's
version, no NVIDIA libraries, no driver) importable, and ``JAX_PLATFORMS=cpu`` set before JAX is
imported. It is kept out of the project's virtual environment (installed there, a plain
``import jax`` prints a cuDNN error on machines without a GPU): `launch/install.sh` puts it in
``.gpu_aot/`` of the checkout (`plugin_dir`), and tools run in a subprocess with
`compile_env` (that directory on ``PYTHONPATH``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import sys
import time
from typing import Any, Mapping, Sequence

import jax
from jax.experimental import topologies

from jax._src.lib import _jax  # private: XLA's cost analysis of a compiled module

try:  # private JAX module: its trace-time questions to the local GPU (`target_answers`)
  from jax._src.cudnn import fused_attention_stablehlo as _cudnn
except ImportError:  # pragma: no cover - a JAX without it
  _cudnn = None

from disa_jax.parallel import hlo_facts

CARDS_DIR = pathlib.Path(__file__).resolve().parent / "gpu_cards"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN_ENV = "DISA_GPU_AOT"  # overrides the plugin directory
TOPOLOGIES = ("1x1x1", "1x1x8", "1x2x8")
# Dense bfloat16 tensor-core peak (NVIDIA data sheets: H100 / H200 SXM 989.4 TFLOP/s without
# sparsity, A100 312 TFLOP/s); the card descriptions give memory size and bandwidth, not this.
BF16_PEAK = {"h100_sxm": 989.4e12, "h200": 989.4e12, "a100_sxm_80": 312e12}
# The cuDNN a GPU run would load: jax-cuda13-plugin 0.10.2 requires nvidia-cudnn-cu13 >= 9.12.
CUDNN_VERSION = 91200


@dataclasses.dataclass(frozen=True)
class Card:
  """A GPU model: its XLA target description and the figures a step-time bound needs."""
  name: str
  target_config: str  # GpuTargetConfigProto text
  device_name: str
  memory_bytes: int
  hbm_bytes_per_s: float
  bf16_flops_per_s: float
  compute_capability: tuple[int, int]


def _field(text: str, name: str) -> str:
  m = re.search(rf"^\s*{name}:\s*(\S+)", text, re.M)
  if m is None:
    raise ValueError(f"card description has no {name!r} field")
  return m.group(1).strip('"')


@functools.cache
def load_card(name: str) -> Card:
  """The `Card` ``name`` (one of `BF16_PEAK`'s keys)."""
  path = CARDS_DIR / f"{name}.txtpb"
  if name not in BF16_PEAK or not path.exists():
    raise ValueError(f"card={name!r}: expected one of {sorted(BF16_PEAK)}")
  text = path.read_text()
  device = re.search(r'^\s*name:\s*"([^"]+)"', text, re.M)
  cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
  version = tuple(int((re.search(rf"{k}:\s*(\d+)", cc.group(1)) or [0, 0])[1]) if cc else 0
                  for k in ("major", "minor"))
  return Card(name, text, device.group(1) if device else name,
              int(_field(text, "device_memory_size")), float(_field(text, "memory_bandwidth")),
              BF16_PEAK[name], version)  # type: ignore[arg-type]


def plugin_dir() -> pathlib.Path:
  """Where the CUDA plugin for compile-only use is installed (``$DISA_GPU_AOT`` or
  ``<checkout>/.gpu_aot``)."""
  return pathlib.Path(os.environ.get(PLUGIN_ENV) or REPO_ROOT / ".gpu_aot")


def plugin_installed(path: pathlib.Path | None = None) -> bool:
  path = plugin_dir() if path is None else path
  return (path / "jax_plugins").is_dir() and any(path.glob("jax_cuda*_plugin"))


def plugin_on_path() -> bool:
  """Whether this process found the plugin directory on its path (set before JAX starts)."""
  target = plugin_dir().resolve()
  return any(pathlib.Path(p or ".").resolve() == target for p in sys.path)


def compile_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
  """An environment for a compile subprocess: the plugin and this checkout on ``PYTHONPATH``,
  ``JAX_PLATFORMS=cpu`` (abstract CUDA devices come from the plugin, nothing runs)."""
  env = dict(os.environ if base is None else base)
  paths = [str(plugin_dir()), str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(
      os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(paths)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def parse_topology(topology: str) -> tuple[int, int, int]:
  """``'1x2x8'`` -> (partitions, hosts, devices per host)."""
  parts = topology.split("x")
  if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"topology={topology!r}: expected partitions x hosts x devices, e.g. "
                     f"{' / '.join(TOPOLOGIES)}")
  return tuple(int(p) for p in parts)  # type: ignore[return-value]


def topology_devices(card: Card, topology: str) -> list[Any]:
  """Abstract CUDA devices of ``card`` in ``topology`` (needs the plugin, see the module
  docstring); `parallel.make_mesh(..., devices=...)` lays a mesh over them."""
  parse_topology(topology)
  try:
    desc = topologies.get_topology_desc(platform="cuda", target_config=card.target_config,
                                        topology=topology)
  except Exception as e:  # the plugin raises various types when absent
    raise RuntimeError(f"cannot make a CUDA topology {topology!r} for card {card.name!r} ({e}); "
                       f"is the CUDA plugin on PYTHONPATH ({plugin_dir()}, launch/install.sh) "
                       "and JAX_PLATFORMS=cpu set before JAX is imported?") from e
  return list(desc.devices)


@contextlib.contextmanager
def target_answers(card: Card):
  """While tracing for ``card``: JAX's cuDNN attention module asks the local GPU for its cuDNN
  version and compute capability when it builds the call (there is none here, so it would refuse
  the packed layout); it gets the target's answers (`CUDNN_VERSION`, ``card``'s capability)."""
  if _cudnn is None:
    yield
    return
  names = ("check_cudnn_version", "check_compute_capability", "is_cuda_compute_capability_equal")
  saved = {n: getattr(_cudnn, n) for n in names}
  parse = lambda c: tuple(int(x) for x in c.split("."))
  replaced = (lambda: CUDNN_VERSION, lambda c: card.compute_capability >= parse(c),
              lambda c: card.compute_capability == parse(c))
  for n, fn in zip(names, replaced):
    setattr(_cudnn, n, fn)
  try:
    yield
  finally:
    for n, fn in saved.items():
      setattr(_cudnn, n, fn)


@dataclasses.dataclass(frozen=True)
class ProgramReport:
  """One compiled program, per device (bytes) and per run (FLOPs, counts)."""
  name: str
  card: str
  topology: str
  compile_s: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  capacity_bytes: int
  xla_flops: float  # XLA's cost analysis of the optimized module: a while body counted once
  dot_flops: int  # matmul FLOPs with each loop body counted per trip (`hlo_facts`)
  facts: hlo_facts.ModuleFacts

  @property
  def total_bytes(self) -> int:
    """Live bytes while it runs: arguments + outputs not aliased to a donated argument + temps."""
    return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

  @property
  def fits(self) -> bool:
    return self.total_bytes <= self.capacity_bytes

  def step_floor_s(self, card: Card, extra_flops: float = 0.0) -> dict[str, float]:
    """A lower bound on one run: its FLOPs (``dot_flops`` + ``extra_flops``, e.g. a cuDNN
    attention's) at the bf16 peak, and reading its arguments once and writing/reading its
    temporaries once at the HBM bandwidth; the bound is the larger of the two."""
    compute = (self.dot_flops + extra_flops) / card.bf16_flops_per_s
    memory = (self.argument_bytes + self.output_bytes + 2 * self.temp_bytes) / card.hbm_bytes_per_s
    return {"compute_s": compute, "memory_s": memory, "bound_s": max(compute, memory)}

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(total_bytes=self.total_bytes, fits=self.fits,
             data_dependent_loops=[w.name for w in self.facts.data_dependent_loops])
    return d


def xla_cost_flops(compiled: Any) -> float:
  """XLA's cost analysis of the optimized module (a private JAX API; a loop body counted once)."""
  module = compiled.runtime_executable().hlo_modules()[0]
  cost = _jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client, module)
  return float(cost.get("flops", 0.0))  # absent from a module without arithmetic (slices)


def compile_report(name: str, lowered: jax.stages.Lowered, card: Card, topology: str
                   ) -> ProgramReport:
  """Compiles ``lowered`` (lowered on `topology_devices` inputs; nothing runs) into a
  `ProgramReport`."""
  t0 = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  facts = hlo_facts.read_module(compiled.as_text(), top=16)
  return ProgramReport(name, card.name, topology, round(seconds, 2),
                       int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                       int(m.alias_size_in_bytes), int(m.temp_size_in_bytes), card.memory_bytes,
                       xla_cost_flops(compiled), facts.dot_flops, facts)


def square_buffers(report: ProgramReport, row_len: int, widths: Sequence[int] = ()
                   ) -> list[hlo_facts.Buffer]:
  """The buffers quadratic in the row length T: at least T^2 elements and two dimensions that are
  multiples of T other than the model's own ``widths`` (a [B, T, T] mask or score matrix, cuDNN
  statistics [B x M, N, T] with one segment slot per token); parameters, [T, vocab] logits and a
  [T, width] activation whose width happens to equal T are not (nor, then, a [T, T] buffer at a
  row length equal to a model width: check at a T that is none)."""
  t, skip = row_len, set(widths)
  return [b for b in report.facts.largest if b.elements >= t * t
          and sum(d >= t and d % t == 0 and d not in skip for d in _dims(b.shape)) >= 2]


def _dims(shape: str) -> tuple[int, ...]:
  return tuple(int(d) for d in shape[shape.index("[") + 1:-1].split(",") if d)


def gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


def summary_line(r: ProgramReport) -> str:
  """One printed line of a report (GiB per device)."""
  big = ", ".join(f"{b.shape}" for b in r.facts.largest[:3])
  loops = r.facts.data_dependent_loops
  return (f"{r.name}: compile {r.compile_s:.1f} s; args {gib(r.argument_bytes)} out "
          f"{gib(r.output_bytes)} alias {gib(r.alias_bytes)} temp {gib(r.temp_bytes)} = "
          f"{gib(r.total_bytes)} of {gib(r.capacity_bytes)} GiB ({'fits' if r.fits else 'NO'}); "
          f"{r.dot_flops / 1e12:.2f} TFLOP (dots per run), XLA {r.xla_flops / 1e12:.2f}; largest "
          f"{big}; custom calls {r.facts.custom_calls or '-'}; collectives "
          f"{ {k: v['count'] for k, v in r.facts.collectives.items()} or '-'}; "
          f"{len(loops)} data-dependent loop(s)" + (
              f"; cuDNN segment slots {list(r.facts.cudnn_segment_slots)}"
              if r.facts.cudnn_segment_slots else ""))

