"""The Stage 3 trainer's programs on abstract inputs, for compiling without running them.

`programs_for` builds what `rl.update.PolicyUpdater` builds for a run (the policy with the run's
`stage3.model_options`, the clipped AdamW of its config, `update.make_train_step` with the state's
shardings, `scoring.batched.make_scoring_fn` for pi_old / pi_ref), but from `jax.eval_shape`: the
parameters, optimizer state and micro-batches are `jax.ShapeDtypeStruct`s placed on a mesh, which
may be fake CPU devices or the abstract GPUs of a deviceless topology (`parallel.gpu_compile`).
Nothing is allocated; `Programs.step.lower(state, batch)` and `Programs.score.lower(params, rows)`
give the trainer's own programs. `benchmarks/plan_memory.py` (memory, FLOPs and kernels per card)
and `benchmarks/bench_gpu_train.py` (the measured step) use it, so the compiled and the measured
programs are the trainer's (issue 66: a benchmark's own copy of the model options left out
``max_segments``).

`useful_flops` is the model FLOPs of one update on given sequences: 6 N tokens + causal attention
inside each packed sequence (N: the matmul parameters).
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax import parallel
from disa_jax.parallel import gpu_compile
from disa_jax.parallel.gpu_compile import gib
from disa_jax.data.packing import PackedRows, PackingLayout
from disa_jax.models import attention_dispatch
from disa_jax.models.config import ModelConfig
from disa_jax.models.transformer import Transformer
from disa_jax.rl import update as rl_update
from disa_jax.rl.batch import TrainBatch
from disa_jax.rl.config import TrainConfig
from disa_jax.scoring.batched import make_scoring_fn
from disa_jax.workflows import stage3


@dataclasses.dataclass
class Programs:
  """What the programs of one model share: its abstract state, graph and jitted functions."""
  name: str
  config: ModelConfig
  train: TrainConfig
  mesh: Mesh
  graphdef: Any
  state: rl_update.TrainState
  step: Any  # update.make_train_step: ``.lower(state, batch)`` -> {"micro", "finish"}
  score: Any  # scoring.batched.make_scoring_fn (pi_old / pi_ref log-probs, no gradient)
  ref_bytes: int  # the frozen bf16 reference per device
  attention_chunk: int
  attention_impl: str = "xla"  # as resolved for the mesh's platform
  remat_policy: str | None = "full"  # None: no remat
  max_segments: int = 0
  optim: Any = None  # a caller's cache of the optimizer step's compiled facts


def device_bytes(tree: Any, dtype: Any = None) -> int:
  """Bytes one device holds of an abstract tree (leaves with shardings), optionally as ``dtype``."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += math.prod(shape) * jnp.dtype(dtype or x.dtype).itemsize
  return total


def abstract_params(model: nnx.Module, mesh: Mesh) -> tuple[Any, Any]:
  """(graphdef, params as `ShapeDtypeStruct`s with their `TRAIN_RULES` shardings) of an abstract
  model; attaches the activation sharding context as `parallel.shard_model` does."""
  shardings = parallel.model_shardings(model, mesh, parallel.TRAIN_RULES)
  model.sharding = parallel.ShardingContext(mesh, parallel.TRAIN_RULES)
  graphdef, params = nnx.split(model, nnx.Param)
  params = jax.tree.map(
      lambda s, v: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                  sharding=s)),
      shardings, params)
  return graphdef, params


def abstract_opt_state(optimizer: Any, params: Any, mesh: Mesh) -> Any:
  """The optimizer state's shapes with the shardings `update.init_train_state` gives them
  (`update.opt_state_shardings`: moments as their parameters, counts replicated)."""
  shardings = rl_update.opt_state_shardings(optimizer, params, mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      jax.eval_shape(optimizer.init, params), shardings)


def programs_for(name: str, config: ModelConfig, train: TrainConfig, mc: Any, mesh: Mesh,
                 attention_chunk: int) -> Programs:
  """The abstract trained state and the trainer's jitted functions of model ``config`` under a
  Stage 3 run's ``train`` / ``mc`` settings on ``mesh``. The model options are the trainer's
  (`stage3.model_options`), the layers a scan (what ``layer_loop='auto'`` runs on a GPU or TPU; on
  CPU meshes too, so that a CPU plan stands for them), the attention resolved for the mesh's
  device (platform and compute capability)."""
  mc = dataclasses.replace(mc, attention_chunk=attention_chunk)
  options = dataclasses.replace(stage3.model_options(mc, train.rollout, trained=True),
                                layer_loop="scan")
  device = mesh.devices.flat[0]
  impl = attention_dispatch.resolve_impl(mc.attention_impl, backend=device.platform,
                                         dtype=jnp.dtype(mc.dtype), head_dim=config.head_dim,
                                         branches=False,
                                         capability=getattr(device, "compute_capability", None),
                                         row_len=train.rollout.packed_row_len)
  model = nnx.eval_shape(lambda: Transformer(
      config, rngs=nnx.Rngs(0), dtype=jnp.dtype(mc.dtype), param_dtype=jnp.dtype(mc.param_dtype),
      options=options))
  graphdef, params = abstract_params(model, mesh)
  optimizer = rl_update.make_optimizer(train.optim.lr, **rl_update.optimizer_kwargs(train))
  rep = NamedSharding(mesh, PartitionSpec())
  state = rl_update.TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep), params,
                               abstract_opt_state(optimizer, params, mesh), None, None)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  step = rl_update.make_train_step(
      graphdef=graphdef, objective=train.objective, optimizer=optimizer,
      options=rl_update.StepOptions.of(train, joint=False, key_seed=0), mesh=mesh,
      state_shardings=shardings)
  return Programs(name, config, train, mesh, graphdef, state, step,
                  make_scoring_fn(graphdef), ref_bytes=device_bytes(params, mc.dtype),
                  attention_chunk=attention_chunk, attention_impl=impl,
                  remat_policy=mc.remat_policy if mc.remat else None,
                  max_segments=options.max_segments)


def abstract_micro_batch(layout: PackingLayout, width: int, mesh: Mesh) -> TrainBatch:
  """A `TrainBatch` of `ShapeDtypeStruct`s: ``[R, L]`` packed rows over the batch axes, ``[S, W]``
  / ``[S]`` per-sequence arrays replicated (`update.batch_shardings`)."""
  r, l, s = layout.rows, layout.row_len, layout.slots
  sh = rl_update.batch_shardings(mesh)
  row = lambda: jax.ShapeDtypeStruct((r, l), jnp.int32, sharding=sh.rows)
  rep = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh.signal)
  return TrainBatch(rows=PackedRows(*(row() for _ in range(6))),
                    response_index=rep((s, width), jnp.int32),
                    response_mask=rep((s, width), jnp.float32),
                    old_logp=rep((s, width), jnp.float32), ref_logp=rep((s, width), jnp.float32),
                    signal=rep((s,), jnp.float32), log_z=rep((s,), jnp.float32))


def matmul_params(c: ModelConfig) -> int:
  """N: parameters that enter a matmul per token (layers' attention and MLP kernels + the head)."""
  attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)  # q, o; k, v
  mlp = 3 * c.hidden_size * c.intermediate_size  # gate, up, down
  return c.num_layers * (attn + mlp) + c.hidden_size * c.vocab_size


def attention_flops(c: ModelConfig, seq_lens: Sequence[int], *, passes: int = 3) -> int:
  """FLOPs of causal attention inside each packed sequence: 4 per query-key pair and head
  dimension forward (two matmuls), ``passes`` = 3 for forward + backward, 1 for a forward."""
  pairs = sum(s * (s + 1) // 2 for s in seq_lens)
  return passes * 4 * c.num_layers * c.num_heads * c.head_dim * pairs


def useful_flops(c: ModelConfig, seq_lens: Sequence[int]) -> int:
  """Model FLOPs of one update on these sequences: 6 N tokens + causal attention per sequence
  (remat's recomputation, norms and softmax not counted)."""
  return 6 * matmul_params(c) * int(sum(seq_lens)) + attention_flops(c, seq_lens)


@dataclasses.dataclass(frozen=True)
class GpuPlan:
  """One model and micro-batch compiled for a card and topology (`compile_gpu_plan`): the micro
  step (forward + backward + gradient accumulation), the optimizer step and the pi_old scoring
  pass, each a `gpu_compile.ProgramReport` (bytes per device, FLOPs per device and run)."""
  model: str
  layers: int
  row_len: int
  rows: int
  seq_len: int  # the sequences filling each row (useful FLOPs)
  fsdp: int
  attention_impl: str
  remat_policy: str | None
  seqs_per_row: int  # the packing's bound: the cuDNN segment slots it should give
  adam_bytes: int  # AdamW moments per device (resident, not an argument of micro / score)
  ref_bytes: int  # the frozen bf16 reference per device
  useful_flops: float  # per device: 6 N tokens + causal attention within segments, / devices
  attention_call_flops: float  # per device: the fused attention's (cuDNN) FLOPs, not in dot_flops
  programs: dict[str, Any]  # "micro" / "optim" / "score" -> ProgramReport
  widths: tuple[int, ...] = ()  # the model's own dimensions (`model_widths`)

  @property
  def peak(self) -> int:
    """The largest of micro + AdamW, optim, score + AdamW (those compiled), plus the frozen
    reference."""
    resident = {"micro": self.adam_bytes, "optim": 0, "score": self.adam_bytes}
    return max(r.total_bytes + resident[k] for k, r in self.programs.items()) + self.ref_bytes

  @property
  def flops_ratio(self) -> float:
    """The micro step's compiled FLOPs (matmuls per loop trip + the fused attention's) over the
    useful FLOPs."""
    return (self.programs["micro"].dot_flops + self.attention_call_flops) / self.useful_flops

  def checks(self) -> list[str]:
    """What makes this plan wrong for its card (empty: none): a buffer with >= T^2 elements in the
    micro step or the scoring pass; cuDNN segment slots other than the packing's sequences per
    row; the peak over the card's memory."""
    bad = []
    for name in sorted(set(self.programs) & {"micro", "score"}):
      for b in gpu_compile.square_buffers(self.programs[name], self.row_len, self.widths):
        bad.append(f"{name}: buffer {b.shape} ({b.source or b.op}) has >= T^2 = "
                   f"{self.row_len}^2 elements")
    micro = self.programs["micro"]
    slots = micro.facts.cudnn_segment_slots
    if slots and slots != (max(2, self.seqs_per_row),):
      bad.append(f"micro: cuDNN segment slots {list(slots)}, the packing has {self.seqs_per_row} "
                 "sequences per row (Transformer max_segments)")
    if self.peak > micro.capacity_bytes:
      bad.append(f"peak {gpu_compile.gib(self.peak)} GiB per device (micro + AdamW + reference) "
                 f"over the card's {gpu_compile.gib(micro.capacity_bytes)} GiB")
    return bad

  def to_json(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "programs"}
    d.update(peak_bytes=self.peak, flops_ratio=self.flops_ratio, checks=self.checks(),
             programs={k: r.to_json() for k, r in self.programs.items()})
    return d


def model_widths(c: ModelConfig) -> tuple[int, ...]:
  """The model's dimensions that an activation or parameter has besides tokens (a buffer with one
  of these is not quadratic in T however its sizes compare)."""
  h = c.head_dim
  return tuple(sorted({c.hidden_size, c.intermediate_size, 2 * c.intermediate_size, c.vocab_size,
                       c.num_heads * h, c.num_kv_heads * h, (c.num_heads + 2 * c.num_kv_heads) * h,
                       c.num_heads, c.num_kv_heads, h}))


def _attention_call_flops(p: Programs, report: gpu_compile.ProgramReport,
                          seq_lens: Sequence[int]) -> float:
  """FLOPs of the fused attention calls of ``report`` (not in its matmul count): each forward
  call (a layer's forward or its remat recomputation) the per-layer causal FLOPs of this device's
  sequences, each backward call 2.5x that (five matmuls against two)."""
  calls = report.facts.custom_calls
  fwd = sum(n for t, n in calls.items() if "fmha" in t and "Backward" not in t)
  bwd = sum(n for t, n in calls.items() if "fmha" in t and "Backward" in t)
  per_layer = attention_flops(dataclasses.replace(p.config, num_layers=1), seq_lens, passes=1)
  return (fwd + 2.5 * bwd) * per_layer / p.mesh.size


PROGRAMS = ("micro", "optim", "score")


def compile_gpu_plan(p: Programs, *, rows: int, row_len: int, seq_len: int,
                     card: gpu_compile.Card, topology: str,
                     programs: Sequence[str] = PROGRAMS) -> GpuPlan:
  """Compiles ``programs`` (`PROGRAMS`: the micro step, optimizer step and scoring pass) of
  ``rows`` packed rows of ``row_len`` tokens (``p.mesh`` over `gpu_compile.topology_devices`);
  nothing runs."""
  rc, shards = p.train.rollout, parallel.batch_shards(p.mesh)
  if rows % shards or row_len % seq_len:
    raise ValueError(f"rows={rows} must be a multiple of the {shards} batch shards and "
                     f"seq_len={seq_len} divide row_len={row_len}")
  layout = PackingLayout(row_len=row_len, rows=rows, seqs_per_row=rc.seqs_per_row)
  mb = abstract_micro_batch(layout, rc.max_response_len, p.mesh)
  with gpu_compile.target_answers(card):
    lowered = p.step.lower(p.state, mb)
    lowered_score = p.score.lower(p.state.params, mb.rows)
  lowered = {"micro": lowered["micro"], "optim": lowered["finish"], "score": lowered_score}
  if "micro" not in programs or set(programs) - set(PROGRAMS):
    raise ValueError(f"programs={programs!r}: 'micro' and any of {PROGRAMS}")
  programs = {k: gpu_compile.compile_report(k, lowered[k], card, topology) for k in programs}
  seqs = [seq_len] * (rows * (row_len // seq_len))
  return GpuPlan(p.name, p.config.num_layers, row_len, rows, seq_len, p.mesh.shape["fsdp"],
                 p.attention_impl, p.remat_policy, rc.seqs_per_row,
                 adam_bytes=device_bytes(p.state.opt_state), ref_bytes=p.ref_bytes,
                 useful_flops=useful_flops(p.config, seqs) / p.mesh.size,
                 attention_call_flops=_attention_call_flops(p, programs["micro"], seqs),
                 programs=programs, widths=model_widths(p.config))


GPU_TABLE_HEADER = ("card", "topology", "model", "rows x T", "attention", "remat", "compile s",
                    "micro args+temp", "peak", "card", "FLOPs / useful", "micro floor ms",
                    "collectives (micro)", "checks")


def _gpu_table_row(out: dict[str, Any], r: dict[str, Any]) -> tuple[str, ...]:
  """One plan of a ``--card --json`` file as a table row (GiB per device)."""
  head = (out["card"], out["topology"], f"{r['model']}" + (f" ({r['layers']} layers)" if
                                                          r.get("layers") else ""),
          f"{r['rows']} x {r['row_len']}", r["attention_impl"], r["remat_policy"] or "off")
  if "error" in r:
    return head + ("-",) * 7 + (r["error"][:80],)
  m = r["programs"]["micro"]
  compute = (m["dot_flops"] + r["attention_call_flops"]) / out["bf16_flops_per_s"]
  memory = (m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"]) / out["hbm_bytes_per_s"]
  colls = ", ".join(f"{k} {v['count']} ({v['bytes'] / 2**30:.1f} GiB)"
                    for k, v in sorted(m["facts"]["collectives"].items())) or "-"
  return head + (
      " / ".join(f"{p['compile_s']:.0f}" for p in r["programs"].values()),
      f"{gib(m['argument_bytes'])} + {gib(m['temp_bytes'])}", gib(r["peak_bytes"]),
      gib(out["memory_bytes"]), f"{r['flops_ratio']:.2f}", f"{max(compute, memory) * 1e3:.0f}",
      colls, "; ".join(r["checks"]) or "pass")


def format_gpu_tables(paths: Sequence[str]) -> str:
  """A Markdown table of the plans in ``--card --json`` files (what docs/cluster.md quotes)."""
  rows = [GPU_TABLE_HEADER]
  for path in paths:
    with open(path) as f:
      out = json.load(f)
    rows += [_gpu_table_row(out, r) for r in out["plans"]]
  line = lambda r: "| " + " | ".join(r) + " |"
  return "\n".join([line(rows[0]), "|" + "---|" * len(GPU_TABLE_HEADER)] +
                   [line(r) for r in rows[1:]])


def gpu_plan_text(g: GpuPlan, card: gpu_compile.Card) -> str:
  """A plan's printed block: its programs' summary lines, FLOPs, step-time floors and checks."""
  micro, optim = g.programs["micro"], g.programs.get("optim")
  floor = micro.step_floor_s(card, g.attention_call_flops)
  optim_floor = f"{optim.step_floor_s(card)['bound_s'] * 1e3:.0f} ms" if optim else "-"
  lines = [f"{g.model} ({g.layers} layers) rows={g.rows} x {g.row_len} ({g.seq_len}-token "
           f"sequences) fsdp={g.fsdp} attention={g.attention_impl} remat="
           f"{g.remat_policy or 'off'}: peak {gib(g.peak)} GiB/device with AdamW and "
           f"reference; compiled/useful FLOPs {g.flops_ratio:.2f}; micro-step floor "
           f"{floor['bound_s'] * 1e3:.0f} ms (compute {floor['compute_s'] * 1e3:.0f}, memory "
           f"{floor['memory_s'] * 1e3:.0f}), optimizer step floor {optim_floor}"]
  lines += ["  " + gpu_compile.summary_line(r) for r in g.programs.values()]
  lines += ["  CHECK FAILED: " + c for c in g.checks()]
  return "\n".join(lines)
