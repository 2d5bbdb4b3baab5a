"""Device memory of a Stage 3 micro-batch step, from XLA's compiled memory analysis (no execution).

Two compilers, one tool. With ``--card {h100_sxm,h200,a100_sxm_80} [--topology 1x1x1|1x1x8|1x2x8]``
the programs are compiled by XLA:GPU for that card, deviceless (`disa_jax.parallel.gpu_compile`;
the CUDA plugin of `launch/install.sh`, in ``.gpu_aot/``: the tool re-runs itself with it on
PYTHONPATH), and each plan reports per program: compile seconds, per-device argument / output /
alias / temp bytes against the card, matmul FLOPs per loop trip against the useful FLOPs, the
largest buffers, custom calls, collectives, data-dependent loops, a step-time floor, and the
checks of `stage3_programs.GpuPlan` (``--check``: exit 1 when one fails; ``--json``: one file;
``--markdown FILE...``: the table docs/cluster.md quotes). e.g.
  python benchmarks/plan_memory.py --card h200 --models qwen3-4b-base --rows 1 --row-lens 16384 \
      --attention-impl auto,xla --remat-policy full,save_qkv_attn_mlp [--layers 2] --json FILE
Without ``--card``: XLA:CPU on fake devices, a proxy (below).

For each model preset and micro-batch shape, the programs the Stage 3 trainer jits are lowered on
abstract inputs (`jax.ShapeDtypeStruct` with the trainer's shardings) and compiled, never run:

- ``micro``: forward + backward of one packed micro-batch and the gradient accumulation
  (`update.make_train_step`'s micro step, through ``step.lower``);
- ``optim``: the optimizer step (global-norm clip + AdamW) on the accumulated gradients;
- ``score``: the no-gradient pi_old scoring pass (`scoring.batched.make_scoring_fn`) over the
  same rows.

Settings come from the paper's Stage 3 config (``configs/stage3_paper.py:disa,<preset>,math``):
bf16 compute, f32 parameters (the AdamW master copy), clipped AdamW, remat with
``model.remat_policy`` (``--remat-policy`` compares several), the DISA objective,
``max_response_len`` wide per-sequence arrays, ``seqs_per_row`` slots per row, the attention query
block ``model.attention_chunk`` (``--attention-chunk``; 0 = none) and ``model.attention_impl`` as
it resolves on this CPU ('auto' = 'xla' for the plan's long rows, 'dense' at <= 256 tokens; the GPU
kernels do not compile here). The mesh is ``fsdp``
x 1 over fake CPU devices with the training rules (`parallel.TRAIN_RULES`); the layers run as a
scan (what ``layer_loop='auto'`` picks on a GPU; one layer body is compiled).

Per device, for one micro-batch size: ``micro`` = its arguments (params, gradient accumulator,
batch) + outputs - aliased (donated) + temporaries; the AdamW moments are resident but not an
argument of ``micro`` and are added (``+adam``). ``peak`` = the largest of micro + AdamW, optim,
and score + AdamW. ``+ref`` adds the frozen bf16 reference model the DISA trainer also keeps
sharded on the same devices.

CPU compilation is a proxy for GPU memory: see `CAVEATS` (printed with the table).

Usage (about 8 minutes on 2 CPU cores; ``--quick``: under a minute; docs/cluster.md has the table):
  python benchmarks/plan_memory.py [--models qwen3-4b-base,qwen2.5-7b] [--rows 8,16,32,64]
      [--row-lens 4096,8192,18432] [--attention-chunk C] [--fsdp 8] [--capacity-gib 80]
      [--no-dense-check] [--no-search] [--quick] [--settings-of qwen3-4b-base] [--no-remat]
      [--remat-policy full,save_qkv_attn,save_qkv_attn_mlp] [--attention-impl xla|dense]
One GPU (what `bench_gpu_train.py` measures), e.g.:
  python benchmarks/plan_memory.py --models qwen3-0.6b,qwen3-1.7b,qwen3-4b-base \
      --settings-of qwen3-4b-base --fsdp 1 --rows 1 --row-lens 8192,16384 --no-dense-check \
      --no-search --capacity-gib 139 [--no-remat] [--json FILE]
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before JAX is imported: fake CPU devices for the mesh
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  _FLAGS = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _FLAGS:
    os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()
  _ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any, Sequence  # noqa: E402

import jax  # noqa: E402

from configs import stage3_paper  # noqa: E402
from disa_jax import config as config_lib  # noqa: E402
from disa_jax import parallel  # noqa: E402
from disa_jax.data.packing import PackingLayout  # noqa: E402
from disa_jax.models.config import get_preset  # noqa: E402
from disa_jax.parallel import gpu_compile  # noqa: E402
from disa_jax.parallel.gpu_compile import gib  # noqa: E402
from disa_jax.rl.config import TrainConfig  # noqa: E402
from disa_jax.workflows.stage3_programs import (Programs, abstract_micro_batch,  # noqa: E402
                                                compile_gpu_plan, device_bytes,
                                                format_gpu_tables, gpu_plan_text, programs_for)
from disa_jax.workflows.stage3 import Stage3Config  # noqa: E402

GIB = 1 << 30
DEFAULT_MODELS = ("qwen3-4b-base", "qwen2.5-7b")
CAVEATS = """\
CPU compilation is a proxy for GPU memory. The numbers are XLA:CPU's buffer assignment of the same
programs on fake devices; a GPU run differs, and some of what it needs is not counted at all:
- XLA:GPU fuses and assigns buffers differently (other fusions, rematerialisation and scheduling),
  so temporaries differ, in either direction; XLA:CPU keeps some bf16 buffers in f32 (e.g. the
  per-layer residual stack that remat saves), which a GPU keeps in bf16;
- the attention is the XLA one ('xla' query blocks or model.attention_chunk chunks, f32 scores of
  a block materialised; 'dense': the [T, T]-mask path); a GPU's default, cuDNN flash attention,
  keeps only the output and a float32 log-sum-exp per query and head, so it needs less;
- cuDNN / cuBLAS workspaces (flash attention if used, GEMM workspace) are not counted;
- NCCL communication buffers of the FSDP all-gathers / reduce-scatters are not counted;
- allocator fragmentation and XLA's preallocation (JAX takes 75% of the GPU unless
  XLA_PYTHON_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_PREALLOCATE say otherwise) are not modelled;
- the CUDA context (~0.5-1 GiB per process), a colocated vLLM process (gpu_memory_utilization of
  the GPU), the anchor's prompt-embedding pass and host-side buffers are not counted.
Keep a margin of 10-20% below the device's capacity."""


def paper_train_config(preset: str) -> tuple[TrainConfig, Any]:
  """``configs/stage3_paper.py:disa,<preset>,math`` as (`TrainConfig`, its model section)."""
  cfg = Stage3Config.from_config(stage3_paper.get_config(f"disa,{preset},math"))
  if cfg.train.objective.has_state:
    raise ValueError(f"objective {cfg.train.objective.name!r} has trainable state; the planner "
                     "compiles the policy only")
  return cfg.train, cfg.model




def make_programs(name: str, *, fsdp: int, attention_chunk: int | None = None,
                  devices: Sequence[Any] | None = None, settings_of: str | None = None,
                  remat: bool | None = None, remat_policy: str | None = None,
                  attention_impl: str | None = None, num_layers: int | None = None) -> Programs:
  """The abstract trained state and the trainer's jitted functions for preset ``name`` on an
  ``fsdp``-wide mesh over ``devices`` (default `jax.devices()`).

  The Stage 3 settings are those of the paper config of backbone ``settings_of`` (default:
  ``name``, a paper backbone); ``attention_chunk`` (0 = none), ``remat``, ``remat_policy`` and
  ``attention_impl`` override its model section, ``num_layers`` the preset's depth.
  """
  train, mc = paper_train_config(settings_of or name)
  overrides = dict(remat=remat, remat_policy=remat_policy, attention_impl=attention_impl,
                   attention_chunk=attention_chunk)
  mc = dataclasses.replace(mc, **{k: v for k, v in overrides.items() if v is not None})
  config = get_preset(name)
  if num_layers is not None:
    config = dataclasses.replace(config, num_layers=num_layers)
  devices = list(jax.devices() if devices is None else devices)
  if fsdp > len(devices):
    raise ValueError(f"--fsdp={fsdp} needs {fsdp} devices, this process has {len(devices)} (set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={fsdp}, or a topology)")
  mesh = parallel.make_mesh(1, fsdp, 1, devices=devices[:fsdp])
  return programs_for(name, config, train, mc, mesh, mc.attention_chunk)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
  """XLA's memory analysis of one compiled program, per device, in bytes."""
  argument: int
  output: int
  alias: int
  temp: int
  code: int
  compile_s: float

  @classmethod
  def of(cls, lowered: jax.stages.Lowered) -> "ProgramMemory":
    """Compiles ``lowered`` (nothing runs) and reads its memory analysis."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    if m is None:
      raise RuntimeError(f"the {jax.default_backend()} backend gives no memory analysis")
    return cls(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
               int(m.alias_size_in_bytes), int(m.temp_size_in_bytes),
               int(m.generated_code_size_in_bytes), seconds)

  @property
  def peak(self) -> int:
    """Live bytes while it runs: arguments + outputs not aliased to a donated argument + temps."""
    return self.argument + self.output - self.alias + self.temp


@dataclasses.dataclass(frozen=True)
class Plan:
  """One model and micro-batch shape: its programs' memory per device (see the module docstring)."""
  model: str
  row_len: int
  rows: int
  fsdp: int
  attention_chunk: int
  attention_impl: str
  remat_policy: str | None  # None: no remat
  micro: ProgramMemory
  optim: ProgramMemory
  score: ProgramMemory | None
  adam_bytes: int  # AdamW moments per device: resident, not an argument of micro / score
  ref_bytes: int  # the frozen bf16 reference model per device

  @property
  def tokens(self) -> int:
    return self.rows * self.row_len

  @property
  def peak(self) -> int:
    """The largest of micro + AdamW, optim, score + AdamW."""
    score = self.score.peak + self.adam_bytes if self.score is not None else 0
    return max(self.micro.peak + self.adam_bytes, self.optim.peak, score)

  @property
  def peak_with_ref(self) -> int:
    return self.peak + self.ref_bytes


def plan(setup: Programs, *, rows: int, row_len: int, with_score: bool = True) -> Plan:
  """Compiles the micro step (and the scoring pass; the optimizer step once per setup)."""
  rc, attention_chunk = setup.train.rollout, setup.attention_chunk
  batch_shards = setup.mesh.shape["data"] * setup.mesh.shape["fsdp"]
  if rows % batch_shards:
    raise ValueError(f"--rows value {rows} must be a multiple of the {batch_shards} batch shards "
                     "(rollout.micro_batch_rows must be, see rl/build.py)")
  layout = PackingLayout(row_len=row_len, rows=rows, seqs_per_row=rc.seqs_per_row)
  mb = abstract_micro_batch(layout, rc.max_response_len, setup.mesh)
  lowered = setup.step.lower(setup.state, mb)
  if setup.optim is None:
    setup.optim = ProgramMemory.of(lowered["finish"])
  score = ProgramMemory.of(setup.score.lower(setup.state.params, mb.rows)) if with_score else None
  return Plan(setup.name, row_len, rows, setup.mesh.shape["fsdp"], attention_chunk,
              setup.attention_impl, setup.remat_policy, ProgramMemory.of(lowered["micro"]),
              setup.optim, score,
              adam_bytes=device_bytes(setup.state.opt_state), ref_bytes=setup.ref_bytes)


def plan_record(p: Plan, remat: bool | None) -> dict[str, Any]:
  """One plan as a JSON-able dict (bytes per device; ``micro`` includes the AdamW moments)."""
  return dict(model=p.model, row_len=p.row_len, rows=p.rows, fsdp=p.fsdp,
              attention_chunk=p.attention_chunk, attention_impl=p.attention_impl, remat=remat,
              remat_policy=p.remat_policy,
              micro=p.micro.peak + p.adam_bytes, optim=p.optim.peak,
              score=None if p.score is None else p.score.peak + p.adam_bytes, peak=p.peak,
              peak_with_ref=p.peak_with_ref)


TABLE_HEADER = ("model", "row_len", "rows", "tokens", "tok/dev", "attn", "remat", "args", "temp",
                "out", "+adam", "micro", "optim", "score", "peak", "+ref", "fits")


def attention_label(p: Plan) -> str:
  """'xla', 'xla/1024' (query chunks), 'dense/1024', ..."""
  return p.attention_impl + (f"/{p.attention_chunk}" if p.attention_chunk else "")


def table_row(p: Plan, capacity: int) -> tuple[str, ...]:
  """One printed row (GiB per device; ``micro`` includes ``+adam``, see the module docstring)."""
  m = p.micro
  score = gib(p.score.peak + p.adam_bytes) if p.score is not None else "-"
  return (p.model, str(p.row_len), str(p.rows), str(p.tokens), str(p.tokens // p.fsdp),
          attention_label(p), p.remat_policy or "off", gib(m.argument), gib(m.temp),
          gib(m.output - m.alias), gib(p.adam_bytes), gib(m.peak + p.adam_bytes),
          gib(p.optim.peak), score, gib(p.peak), gib(p.peak_with_ref),
          "yes" if p.peak_with_ref <= capacity else "NO")


def format_table(plans: Sequence[Plan], capacity: int) -> str:
  """A Markdown table of ``plans`` (what docs/cluster.md quotes)."""
  rows = [TABLE_HEADER] + [table_row(p, capacity) for p in plans]
  widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEADER))]
  line = lambda r: "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |"
  sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
  return "\n".join([line(rows[0]), sep] + [line(r) for r in rows[1:]])


def largest_fit(setup: Programs, plans: Sequence[Plan], *, row_len: int, capacity: int,
                log: Any = print) -> Plan | None:
  """The most rows (a multiple of the batch shards) at ``row_len`` whose peak with the reference
  fits ``capacity``: a line through the two largest measured sizes predicts it, compiling checks
  it (stepping down, or up while the next size still fits). None when even the smallest does not.
  """
  shards = setup.mesh.shape["data"] * setup.mesh.shape["fsdp"]
  known = {p.rows: p for p in plans if p.model == setup.name and p.row_len == row_len
           and (p.attention_chunk, p.attention_impl, p.remat_policy)
           == (setup.attention_chunk, setup.attention_impl, setup.remat_policy)}

  def measure(rows: int) -> Plan:
    if rows not in known:
      log(f"  search: compiling rows={rows} ...")
      known[rows] = plan(setup, rows=rows, row_len=row_len, with_score=False)
    return known[rows]

  if not known:
    measure(shards)
  pts = sorted(known.items())
  (r0, p0), (r1, p1) = (pts[0], pts[-1]) if len(pts) > 1 else (pts[0], (0, None))
  if p1 is None:
    slope = p0.peak_with_ref / r0  # one point: proportional
    base = 0.0
  else:
    slope = (p1.peak_with_ref - p0.peak_with_ref) / (r1 - r0)
    base = p0.peak_with_ref - slope * r0
  guess = max(shards, int((capacity - base) / max(slope, 1)) // shards * shards)
  rows = guess
  while rows >= shards and measure(rows).peak_with_ref > capacity:
    rows -= shards
  if rows < shards:
    return None
  while measure(rows + shards).peak_with_ref <= capacity:
    rows += shards
  return known[rows]


def int_list(flag: str, text: str) -> list[int]:
  """``'8,16'`` -> ``[8, 16]``, with an error naming ``flag``."""
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise SystemExit(f"{flag}={text!r}: expected comma-separated integers") from None
  if not values or min(values) < 1:
    raise SystemExit(f"{flag}={text!r}: expected positive integers")
  return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """The command line (see the module docstring); ``--quick`` shrinks the defaults."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                  help="model presets (disa_jax/models/config.py PRESETS), comma-separated")
  ap.add_argument("--rows", default="8,16,32,64", help="rows per micro-batch (multiples of fsdp)")
  ap.add_argument("--row-lens", default="4096,8192,18432",
                  help="tokens per packed row (18432 = the paper config's 2048 + 16384)")
  ap.add_argument("--attention-chunk", type=int, default=None,
                  help="query chunk of the attention (0 = none: the implementation's own "
                  "blocks); default: the paper config's model.attention_chunk")
  ap.add_argument("--fsdp", type=int, default=None,
                  help="FSDP axis size (default: 8 fake CPU devices; with --card, the topology's)")
  ap.add_argument("--card", default=None, choices=sorted(gpu_compile.BF16_PEAK),
                  help="compile for this GPU with XLA:GPU, deviceless (parallel.gpu_compile; the "
                  "CUDA plugin of launch/install.sh), instead of the XLA:CPU proxy")
  ap.add_argument("--topology", default="1x1x1", choices=gpu_compile.TOPOLOGIES,
                  help="with --card: partitions x hosts x GPUs per host")
  ap.add_argument("--layers", type=int, default=None,
                  help="with --card: override the preset's layer count (e.g. 2 for a CI check)")
  ap.add_argument("--seq-len", type=int, default=2048,
                  help="with --card: the length of the sequences filling each row (useful FLOPs)")
  ap.add_argument("--programs", default="micro,optim,score",
                  help="with --card: which programs to compile (micro is always needed)")
  ap.add_argument("--markdown", nargs="+", default=None, metavar="JSON",
                  help="print the table of these --card --json files (docs/cluster.md) and exit")
  ap.add_argument("--check", action="store_true",
                  help="with --card: exit 1 when a plan fails its checks (GpuPlan.checks)")
  ap.add_argument("--capacity-gib", type=float, default=80.0, help="device memory, GiB")
  ap.add_argument("--settings-of", default=None,
                  help="paper backbone whose Stage 3 config gives the settings (default: each "
                  "model's own; needed for presets that are not paper backbones, e.g. qwen3-0.6b)")
  ap.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                  help="override the config's model.remat (default: the config's, on)")
  ap.add_argument("--remat-policy", default=None,
                  help="remat policies to compare, comma-separated (disa_jax.config.REMAT_POLICIES;"
                  " default: the config's model.remat_policy)")
  ap.add_argument("--attention-impl", default=None,
                  help="attention implementation(s), comma-separated (default: the config's "
                  "model.attention_impl: 'auto', which is 'xla' on a CPU (rows over 256 tokens), "
                  "'cudnn' with --card; "
                  "'dense' = the [T, T]-mask path); the CPU proxy compiles auto / xla / dense")
  ap.add_argument("--dense-check", action=argparse.BooleanOptionalAction, default=True,
                  help="also compile the 'dense' attention without chunks at the largest row "
                  "length, rows = fsdp")
  ap.add_argument("--search", action=argparse.BooleanOptionalAction, default=True,
                  help="find the most rows that fit at the largest row length")
  ap.add_argument("--json", default=None,
                  help="also write each plan as a JSON line to this file (bench_gpu_train --plan)")
  ap.add_argument("--quick", action="store_true",
                  help="qwen3-4b-base, rows 8,16, row length 18432, no dense check or search")
  args = ap.parse_args(argv)
  if args.quick:
    args.models, args.rows, args.row_lens = "qwen3-4b-base", "8,16", "18432"
    args.dense_check = args.search = False
  args.models = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in args.models:
    get_preset(m)  # an unknown name raises, listing the presets
  args.rows, args.row_lens = int_list("--rows", args.rows), int_list("--row-lens", args.row_lens)
  args.attention_impls = [None] if args.attention_impl is None else [
      i.strip() for i in args.attention_impl.split(",") if i.strip()]
  cpu_impls = (None, "auto", "xla", "dense")
  for impl in args.attention_impls:
    if impl not in (config_lib.ATTENTION_IMPLS + (None,) if args.card else cpu_impls):
      raise SystemExit(f"--attention-impl={impl!r}: expected one of "
                       f"{config_lib.ATTENTION_IMPLS if args.card else cpu_impls[1:]}")
  if args.card is None:
    if len(args.attention_impls) > 1:
      raise SystemExit("--attention-impl: one implementation without --card")
    args.fsdp = 8 if args.fsdp is None else args.fsdp
    args.attention_impl = args.attention_impls[0]
  if args.attention_chunk is not None and args.attention_chunk < 0:
    raise SystemExit(f"--attention-chunk={args.attention_chunk}: must be >= 0 (0 = no chunking)")
  args.remat_policies = [None] if args.remat_policy is None else (
      [p.strip() for p in args.remat_policy.split(",") if p.strip()] or [""])
  for p in set(args.remat_policies) - {None} - set(config_lib.REMAT_POLICIES):
    raise SystemExit(f"--remat-policy must be one of {config_lib.REMAT_POLICIES}, got {p!r}")
  if args.remat is False and args.remat_policy is not None:
    raise SystemExit(f"--no-remat with --remat-policy={args.remat_policy}: a policy says what a "
                     "recomputed layer keeps, and --no-remat recomputes none (drop one of the two)")
  if args.fsdp is not None and args.fsdp < 1:
    raise SystemExit(f"--fsdp={args.fsdp}: must be >= 1")
  return args


def run_model(name: str, args: argparse.Namespace, capacity: int, remat_policy: str | None = None
              ) -> tuple[list[Plan], list[str]]:
  """The table rows of one model and remat policy, then (optionally) its largest fit and the
  dense comparison."""
  t0 = time.perf_counter()
  setup = make_programs(name, fsdp=args.fsdp, attention_chunk=args.attention_chunk,
                     settings_of=args.settings_of, remat=args.remat, remat_policy=remat_policy,
                     attention_impl=args.attention_impl)
  name = f"{name} ({setup.remat_policy or 'no remat'})" if len(args.remat_policies) > 1 else name
  plans, notes = [], []
  for row_len in args.row_lens:
    for rows in args.rows:
      plans.append(plan(setup, rows=rows, row_len=row_len))
      print(f"  {name} row_len={row_len} rows={rows}: peak+ref "
            f"{gib(plans[-1].peak_with_ref)} GiB/device", flush=True)
  longest = max(args.row_lens)
  if args.search:
    best = largest_fit(setup, plans, row_len=longest, capacity=capacity)
    if best is not None and best not in plans:
      plans.append(best)
    notes.append(f"{name}: largest micro-batch that fits {args.capacity_gib:g} GiB/device at "
                 f"row_len={longest}: " + (
                     f"{best.tokens} tokens ({best.rows} rows, {best.tokens // args.fsdp} per "
                     f"device; peak+ref {gib(best.peak_with_ref)} GiB)" if best else
                     f"none (rows={args.fsdp} already needs more)"))
  if args.dense_check and (setup.attention_chunk or setup.attention_impl != "dense"):
    dense = plan(make_programs(setup.name, fsdp=args.fsdp, attention_chunk=0,
                            settings_of=args.settings_of, remat=args.remat,
                            remat_policy=remat_policy, attention_impl="dense"),
                 rows=args.fsdp, row_len=longest)
    plans.append(dense)
    notes.append(f"{name}: dense attention at row_len={longest}, rows={args.fsdp}: peak+ref "
                 f"{gib(dense.peak_with_ref)} GiB/device (micro temp {gib(dense.micro.temp)} GiB)")
  notes.append(f"{name}: {time.perf_counter() - t0:.0f} s")
  return plans, notes


def stage3_notes(name: str) -> list[str]:
  """What the paper config's trainer would run: its micro-batch and its attention."""
  train, mc = paper_train_config(name)
  rc = train.rollout
  row_len = rc.row_len or rc.max_prompt_len + rc.max_response_len
  return [f"paper config (configs/stage3_paper.py:disa,{name},math): row_len={row_len}, "
          f"micro_batch_rows={rc.micro_batch_rows}: {row_len * rc.micro_batch_rows} tokens per "
          f"micro-batch; model.attention_chunk={mc.attention_chunk or '0 (dense)'}, "
          f"model.attention_impl={mc.attention_impl!r}, model.remat_policy="
          f"{mc.remat_policy!r} (the policy and the reference are built with them)"]


def run_gpu(args: argparse.Namespace) -> list[dict[str, Any]]:
  """Every model x attention x remat policy x row length x rows, compiled for ``--card``; a
  plan that does not compile is recorded with its error."""
  card = gpu_compile.load_card(args.card)
  devices = gpu_compile.topology_devices(card, args.topology)
  fsdp = args.fsdp or len(devices)
  records = []
  for name in args.models:
    for impl in args.attention_impls:
      for policy in args.remat_policies:
        programs = make_programs(name, fsdp=fsdp, devices=devices,
                                 attention_chunk=args.attention_chunk,
                                 settings_of=args.settings_of, remat=args.remat,
                                 remat_policy=policy, attention_impl=impl, num_layers=args.layers)
        for row_len in args.row_lens:
          for rows in args.rows:
            what = dict(model=name, attention_impl=programs.attention_impl, rows=rows,
                        row_len=row_len, remat_policy=programs.remat_policy)
            try:
              g = compile_gpu_plan(programs, rows=rows, row_len=row_len, seq_len=args.seq_len,
                                   card=card, topology=args.topology,
                                   programs=args.programs.split(","))
            except Exception as e:  # pylint: disable=broad-except  (recorded: the table says why)
              records.append(dict(what, error=f"{type(e).__name__}: {str(e)[:500]}"))
              print(f"{what}: does not compile: {records[-1]['error']}", flush=True)
              continue
            print(gpu_plan_text(g, card), flush=True)
            records.append(g.to_json())
  return records


def main_gpu(args: argparse.Namespace, argv: Sequence[str] | None) -> None:
  t0 = time.perf_counter()
  card = gpu_compile.load_card(args.card)
  print(f"JAX {jax.__version__}, XLA:GPU for {card.device_name} ({args.card}), topology "
        f"{args.topology}, compiled on {jax.default_backend()}", flush=True)
  records = run_gpu(args)
  out = dict(command="python benchmarks/plan_memory.py " + " ".join(
                 sys.argv[1:] if argv is None else argv),
             jax=jax.__version__, card=args.card, device=card.device_name,
             memory_bytes=card.memory_bytes, hbm_bytes_per_s=card.hbm_bytes_per_s,
             bf16_flops_per_s=card.bf16_flops_per_s, topology=args.topology,
             seconds=round(time.perf_counter() - t0, 1), plans=records)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  print(f"total runtime {out['seconds']:.0f} s")
  failed = [r for r in records if r.get("error") or r.get("checks")]
  if args.check and failed:
    raise SystemExit(f"{len(failed)} of {len(records)} plans fail their checks")


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if args.markdown:
    print(format_gpu_tables(args.markdown))
    return
  if args.card:
    if not gpu_compile.plugin_on_path():  # the CUDA plugin must be found when JAX starts
      raise SystemExit(subprocess.call([sys.executable, os.path.abspath(__file__)] + list(
          sys.argv[1:] if argv is None else argv), env=gpu_compile.compile_env()))
    return main_gpu(args, argv)
  t0 = time.perf_counter()
  capacity = int(args.capacity_gib * GIB)
  print(f"JAX {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices; "
        f"fsdp={args.fsdp}; settings of configs/stage3_paper.py:disa,"
        f"{args.settings_of or '<model>'},math (bf16 compute, f32 params + AdamW, remat "
        f"{'of the config' if args.remat is None else args.remat}, layer scan); "
        "attention_chunk=" + (
            str(args.attention_chunk or "dense") if args.attention_chunk is not None else
            "/".join(sorted({str(paper_train_config(args.settings_of or m)[1].attention_chunk
                                 or "dense")
                             for m in args.models})) + " (the config's model.attention_chunk)"),
        flush=True)
  plans, notes = [], []
  for name in args.models:
    for policy in args.remat_policies:
      p, n = run_model(name, args, capacity, policy)
      plans += p
      notes += n
  print("\nGiB per device. args/temp/out: the micro step's arguments (params, grad accumulator, "
        "batch), temporaries, outputs not aliased;\n+adam: AdamW moments (resident); micro = "
        "args + temp + out + adam; optim: the AdamW step; score: pi_old forward + adam;\n"
        "peak: max(micro, optim, score); +ref: plus the frozen bf16 reference; fits: +ref <= "
        f"{args.capacity_gib:g} GiB.\n")
  print(format_table(plans, capacity))
  if args.json:
    with open(args.json, "w") as f:
      for p in plans:
        f.write(json.dumps(plan_record(p, args.remat)) + "\n")
  print()
  for n in notes + stage3_notes(args.settings_of or args.models[0]):
    print(n)
  print(f"\n{CAVEATS}\n\ntotal runtime {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
