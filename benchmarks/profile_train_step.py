"""Where the Stage 3 update's time goes: per-op profile of forward, forward+backward and the update.

Shapes (``--shape``):
- ``peer``: the TRL bench's tiny Qwen3 (vocab 113, d=128, mlp 256, 2 layers, 4 heads / 2 kv heads,
  head_dim 32, untied) on its GRPO batch: 8 prompts of 18-19 tokens x G=8 responses of 1-8 tokens;
- ``default``: the default job's pinned tiny Qwen3 (vocab 108, d=64, mlp 128, 2 layers, 4 heads / 2
  kv heads, head_dim 16) on 8 prompts of 11-12 tokens x G=16 responses of 1-8 tokens;
- ``d512``: `bench_models_speed.py`'s Qwen3 (vocab 32,000, d=512, 4 layers) on 2 prompts x G=4
  sequences of 256 + 256 tokens.

Layouts (``--layout``, `disa_jax.data.packing.PackingLayout`): ``padded`` (one sequence per row,
right-padded to a multiple of 16, all rows in one micro-batch: the bench's ``packing=False``),
``packed`` (``--rows`` x ``--row-len`` tokens, several sequences per row) and ``shared`` (packed
with ``share_prompts``: each prompt once per row, followed by its responses).

Phases, each a separate jitted function on the same parameters:
- ``forward``: `update.policy_forward` on the first micro-batch (no gradient);
- ``fwd+bwd``: value and gradient of a GRPO-like token loss through it;
- ``optimizer``: the trainer's optimizer (clip by global norm + AdamW) on given gradients;
- ``train_step``: the trainer's update (`disa_jax.rl.update.make_train_step`, GRPO, one
  on-policy mini-batch of all micro-batches, a 1-device mesh, as in the TRL bench; no HLO counts:
  it is several jitted programs);
- ``host_pack``: building and placing the micro-batches on the host
  (`SequenceScores.micro_batches`);
- ``generate``: `JaxSampler.generate` in this process (8 prompts x 8 samples of at most 8 new
  tokens at temperature 1 on the peer shape; host packing and unpacking included; no HLO counts).

For each phase it prints: wall time (median, min-max over alternating repetitions), the compiled
HLO's instruction counts (fusions, dots, copies, transposes, scatters, gathers, while loops, ...),
and the thunks that take the time (from a `jax.profiler` trace: microseconds per call summed over
threads, call count, share, and what a fusion contains).

    python benchmarks/profile_train_step.py [--shape peer|default|d512] [--reps 20] [--top 15]
        [--layout padded|packed|shared --rows 24 --row-len 72 --seqs-per-row 16] [--unroll 1]
        [--remat] [--attention auto|dense|xla] [--trace-dir DIR] [--phases forward,fwd+bwd,...]
"""
from __future__ import annotations

import argparse
import collections
import glob
import re
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from disa_jax import models, parallel, runtime
from disa_jax.data import packing
from disa_jax.rl import objectives
from disa_jax.rl import update as rl_update
from disa_jax.rl.batch import RolloutBatch, SequenceScores

SHAPES = {
    "peer": dict(vocab_size=113, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, rope_theta=10000.0),
    "default": dict(vocab_size=108, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0),
    "d512": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=64, rope_theta=1_000_000.0),
}
# Opcodes counted in the compiled module (all computations, fused ones included).
_COUNTED = ("fusion", "dot", "convolution", "custom-call", "copy", "transpose", "scatter", "gather",
            "while", "reduce-window", "dynamic-slice", "dynamic-update-slice", "sort", "call")


def make_model(shape: str, *, remat: bool, unroll: int, attention: str = "auto"
               ) -> models.Transformer:
  """The `shape`'s Qwen3 with random weights (std 0.02), float32, attention by ``attention``
  (`disa_jax.config.ATTENTION_IMPLS`)."""
  config = models.ModelConfig(family="qwen3", qk_norm=True, tie_word_embeddings=False,
                              **SHAPES[shape])
  return models.Transformer(config, rngs=nnx.Rngs(0),
                            options=models.ModelOptions(remat=remat, scan_unroll=unroll,
                                                        attention_impl=attention))


def make_sequences(shape: str, vocab: int) -> SequenceScores:
  """The shape's GRPO batch as the update's per-sequence inputs, a `SequenceScores` (prompt-major
  groups of G sequences sharing one prompt, sampled on-policy, with zero log-probs).

  peer: 8 prompts x G=8, prompts of 18-19 tokens, responses of 1-8 tokens (W = 8);
  d512: 2 prompts x G=4, prompts and responses of 256 tokens (W = 256).
  """
  rng = np.random.default_rng(0)
  if shape in ("peer", "default"):
    p, g, w = 8, 8 if shape == "peer" else 16, 8
    plen = rng.integers(18, 20, p) if shape == "peer" else rng.integers(11, 13, p)
    rlen = rng.integers(1, w + 1, p * g)
  else:
    p, g, w = 2, 4, 256
    plen = np.full(p, 256)
    rlen = np.full(p * g, w)
  prompts = [rng.integers(3, vocab, int(n)).astype(np.int32) for n in plen]
  n = p * g
  responses = [rng.integers(3, vocab, int(r)).astype(np.int32) for r in rlen]
  rollout = RolloutBatch(
      prompt_ids=[str(i) for i in range(p)], prompt_tokens=[tuple(x.tolist()) for x in prompts],
      group_size=g, response_width=w, response_ids=responses, reward=np.zeros(n, np.float32),
      grade_error=np.zeros(n, bool), is_replay=np.zeros(n, bool),
      sampled_logp=[np.zeros(len(r), np.float32) for r in responses], engine_logp=[None] * n,
      finish_reason=["stop"] * n, stored_ref_logp=np.full(n, np.nan))
  return SequenceScores(rollout, signal=rng.normal(size=n).astype(np.float32),
                     old_logp=np.zeros((n, w), np.float32), ref_logp=np.zeros((n, w), np.float32),
                     log_z=np.zeros(n, np.float32))


def make_layout(args, seqs: SequenceScores) -> packing.PackingLayout:
  """``--layout``: 'padded' (one sequence per row, padded to a multiple of 16, all rows in one
  micro-batch, as the TRL bench runs it), 'packed' (``--rows`` x ``--row-len``, FFD) or 'shared'
  (packed, each prompt once per row with its responses: ``share_prompts``)."""
  b = seqs.rollout
  n = b.num_rows
  if args.layout == "padded":
    longest = max(len(p) + len(r) for p, r in zip(b.prompts, b.response_ids))
    return packing.PackingLayout(packing=False, row_len=-(-longest // 16) * 16, rows=n)
  return packing.PackingLayout(row_len=args.row_len, rows=args.rows,
                               seqs_per_row=args.seqs_per_row,
                               **({"share_prompts": True} if args.layout == "shared" else {}))


def build_phases(model: models.Transformer, seqs: SequenceScores, layout: packing.PackingLayout
                 ) -> tuple[dict[str, Callable[[], Any]], dict[str, Callable[[], Any]]]:
  """name -> zero-argument callable running one jitted phase (outputs not donated), and name ->
  its lowering. The model phases run on the layout's first micro-batch; ``train_step`` on all."""
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  parallel.shard_model(model, mesh, parallel.TRAIN_RULES)
  optimizer = rl_update.make_optimizer(1e-4, weight_decay=0.0, grad_clip=1.0)
  graphdef, _, state, shardings = rl_update.init_train_state(model, optimizer, mesh=mesh)
  params = state.params
  idx = np.arange(seqs.rollout.num_rows)
  micro = seqs.micro_batches(idx, layout, pad_id=0)
  placed = rl_update.place_micro_batches(micro, mesh)
  mb0 = placed[0]

  def loss(p):
    logp, _ = rl_update.policy_forward(nnx.merge(graphdef, p), mb0)  # [S, W]
    m = mb0.response_mask
    return -jnp.sum(jnp.exp(logp - jax.lax.stop_gradient(logp)) * mb0.signal[:, None] * m) / m.sum()

  forward = jax.jit(lambda p: rl_update.policy_forward(nnx.merge(graphdef, p), mb0)[0])
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)

  @jax.jit
  def opt(p, o, g):
    updates, o = optimizer.update(g, o, p)
    return rl_update.optax.apply_updates(p, updates), o

  update = rl_update.make_train_step(
      graphdef=graphdef, objective=objectives.Grpo(), optimizer=optimizer, mesh=mesh,
      state_shardings=shardings,
      options=rl_update.StepOptions(donate=False, on_policy_old_logp=True))
  update(state, placed)  # builds the accumulator's initialiser
  host = lambda: rl_update.place_micro_batches(seqs.micro_batches(idx, layout, pad_id=0), mesh)
  return {
      "forward": lambda: forward(params),
      "fwd+bwd": lambda: fwd_bwd(params),
      "optimizer": lambda: opt(params, state.opt_state, grads),
      "train_step": lambda: update(state, placed),
      "host_pack": host,
  }, {
      "forward": lambda: forward.lower(params),
      "fwd+bwd": lambda: fwd_bwd.lower(params),
      "optimizer": lambda: opt.lower(params, state.opt_state, grads),
      "train_step": None,
      "host_pack": None,
  }


def build_generate(model: models.Transformer) -> tuple[Callable[[], Any], Callable[[], Any]]:
  """`JaxSampler.generate` of the TRL bench's rollout (8 prompts x 8, <= 8 new tokens, T = 1).

  Returns (a zero-argument generate call, a zero-argument lowering of its jitted function).
  """
  from disa_jax.rollout.jax_sampler import JaxSampler  # pylint: disable=g-import-not-at-top
  from disa_jax.rollout.types import SamplingParams  # pylint: disable=g-import-not-at-top
  sampler = JaxSampler(model)
  rng = np.random.default_rng(1)
  prompts = [list(rng.integers(3, model.config.vocab_size, int(n))) for n in rng.integers(18, 20, 8)]
  calls = iter(range(1 << 30))
  generate = lambda: sampler.generate(prompts, SamplingParams(
      n=8, temperature=1.0, max_tokens=8, stop_token_ids=(2,), seed=next(calls)))
  generate()
  (key, jitted), = sampler._fns.items()  # pylint: disable=protected-access
  recorded = []

  def recording(*a):
    recorded[:] = a
    return jitted(*a)

  sampler._fns[key] = recording  # pylint: disable=protected-access
  generate()
  return generate, lambda: jitted.lower(*recorded)


def hlo_counts(hlo_text: str) -> collections.Counter:
  """Instruction counts by opcode over every computation of an HLO module's text."""
  counts: collections.Counter = collections.Counter()
  for m in re.finditer(r"=\s*[^=]*?\s([a-z][a-z\-]*)\(", hlo_text):
    counts[m.group(1)] += 1
  return counts


def fusion_contents(hlo_text: str) -> dict[str, str]:
  """Instruction name -> short description: a fusion's notable fused opcodes, else its opcode."""
  comps: dict[str, list[str]] = {}
  current = None
  for line in hlo_text.splitlines():
    head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
    if head:
      current = head.group(1)
      comps[current] = []
      continue
    m = re.search(r"\s([a-z][a-z\-]*)\(", line)
    if current is not None and "=" in line and m:
      comps[current].append(m.group(1))
  notable = {"dot", "scatter", "gather", "reduce", "transpose", "copy", "dynamic-update-slice",
             "dynamic-slice", "reduce-window", "exponential", "log", "sort", "concatenate", "pad"}
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?[\s)]([a-z][a-z0-9\-]*)\(", line)
    if not m:
      continue
    name, opcode = m.groups()
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if opcode == "fusion" and called and called.group(1) in comps:
      ops = collections.Counter(o for o in comps[called.group(1)] if o in notable)
      out[name] = "fusion[" + ",".join(f"{k}x{v}" if v > 1 else k for k, v in ops.items()) + "]"
    else:
      out[name] = opcode
  return out


_SCOPES = ("embed", "attention", "mlp", "logprobs")


def op_scopes(hlo_text: str) -> dict[str, str]:
  """Instruction name -> 'fwd/<scope>' or 'bwd/<scope>' from its `op_name` metadata.

  The scope is the model's `jax.named_scope` (embed, attention, mlp, logprobs) or 'other' (final
  norm, loss, optimizer, ...); 'bwd' when the op comes from a transposed (backward) JAX rule.
  """
  out = {}
  for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*op_name=\"([^\"]*)\"", hlo_text, re.M):
    name, op_name = m.groups()
    scope = next((sc for sc in _SCOPES if re.search(rf"\b{sc}\b", op_name)), "other")
    if "optax" in op_name or "adam" in op_name or "clip" in op_name:
      scope = "optimizer"
    out[name] = ("bwd/" if "transpose(" in op_name else "fwd/") + scope
  return out


def thunk_profile(fn: Callable[[], Any], calls: int, trace_dir: str) -> dict[str, tuple[float, float]]:
  """Thunk name -> (microseconds per call, executions per call), from a profiler trace.

  A thunk's time is its median execution time times its executions per call: robust to the
  preemptions a loaded machine causes (a mean would charge them to whichever op was running).
  """
  jax.block_until_ready(fn())
  with jax.profiler.trace(trace_dir):
    for _ in range(calls):
      jax.block_until_ready(fn())
  path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
  data = jax.profiler.ProfileData.from_file(path)
  durations: dict[str, list[float]] = collections.defaultdict(list)
  skip = ("ThunkExecutor", "ThreadpoolListener", "end: ", "SlinkyThreadPool")
  for plane in data.planes:
    if plane.name != "/host:CPU":
      continue
    for line in plane.lines:
      if line.name == "python":
        continue
      for ev in line.events:
        if not ev.name.startswith(skip):
          durations[ev.name].append(ev.duration_ns / 1e3)
  return {k: (statistics.median(v) * len(v) / calls, len(v) / calls) for k, v in durations.items()}


def time_phases(phases: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
  """Seconds per call of each phase, the phases alternating within each repetition."""
  for fn in phases.values():
    jax.block_until_ready(fn())
  out: dict[str, list[float]] = {k: [] for k in phases}
  for _ in range(reps):
    for name, fn in phases.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      out[name].append(time.perf_counter() - t0)
  return out


def report_phase(name: str, lowered, fn, args, times: list[float]) -> None:
  """Prints one phase: timing, HLO counts (when `lowered` is given), top thunks."""
  text = lowered().compile().as_text() if lowered is not None else ""
  if args.dump_hlo:
    with open(f"{args.dump_hlo}/{name}.hlo.txt", "w") as f:
      f.write(text)
  counts = hlo_counts(text)
  desc = fusion_contents(text)
  scopes = op_scopes(text)
  ms = [t * 1e3 for t in times]
  print(f"\n=== {name}: median {statistics.median(ms):.2f} ms (min {min(ms):.2f}, max {max(ms):.2f},"
        f" n={len(ms)})")
  if text:
    print("  HLO instructions: " + ", ".join(f"{k} {counts[k]}" for k in _COUNTED if counts[k])
        + f"; total {sum(counts.values())}")
  with tempfile.TemporaryDirectory(dir=args.trace_dir) as d:
    prof = thunk_profile(fn, args.trace_calls, d)
  # A while / conditional thunk's time includes the thunks of its body, which are listed too.
  loops = {k: v for k, v in prof.items() if desc.get(k) in ("while", "conditional", "call")}
  prof = {k: v for k, v in prof.items() if k not in loops}
  total = sum(v[0] for v in prof.values())
  print(f"  thunks per call: {sum(v[1] for v in prof.values()):.0f}, their summed time "
        f"{total / 1e3:.2f} ms (all threads; loops: " + ", ".join(
            f"{k} {us / 1e3:.2f} ms" for k, (us, _) in loops.items()) + ")")
  if text:  # kinds and scopes come from the compiled HLO
    by_kind: collections.Counter = collections.Counter()
    for k, (us, _) in prof.items():
      by_kind[_kind(desc.get(k, k))] += us
    print("  by kind (ms/call): " + ", ".join(f"{k} {v / 1e3:.2f}"
                                               for k, v in by_kind.most_common()))
    by_scope: collections.Counter = collections.Counter()
    n_scope: collections.Counter = collections.Counter()
    for k, (us, count) in prof.items():
      by_scope[scopes.get(k, "fwd/other")] += us
      n_scope[scopes.get(k, "fwd/other")] += count
    print("  by scope (ms/call, thunks): " + ", ".join(
        f"{k} {v / 1e3:.2f} ({n_scope[k]:.0f})" for k, v in by_scope.most_common()))
  for k, (us, count) in sorted(prof.items(), key=lambda kv: -kv[1][0])[:args.top]:
    print(f"    {us:9.1f} us {100 * us / total:5.1f}%  x{count:<4.0f} {k:32s} "
          f"{scopes.get(k, ''):15s} {desc.get(k, '')}")


def _kind(desc: str) -> str:
  """Coarse kind of a thunk from its description: matmul, copy/transpose, scatter, ... ."""
  if not desc.startswith("fusion["):
    return {"copy": "copy/transpose", "transpose": "copy/transpose"}.get(desc, desc)
  for key, kind in (("dot", "matmul"), ("scatter", "scatter"), ("gather", "gather"),
                    ("dynamic-update-slice", "dynamic-update-slice"),
                    ("transpose", "copy/transpose"), ("copy", "copy/transpose"),
                    ("reduce", "reduction"), ("dynamic-slice", "dynamic-slice")):
    if key in desc:
      return kind
  return "elementwise"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", choices=sorted(SHAPES), default="peer")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--trace-calls", type=int, default=15)
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--layout", choices=("padded", "packed", "shared"), default="padded")
  ap.add_argument("--rows", type=int, default=24, help="packed layouts: rows per micro-batch")
  ap.add_argument("--row-len", type=int, default=72, help="packed layouts: tokens per row")
  ap.add_argument("--seqs-per-row", type=int, default=16, help="packed layouts: slots per row")
  ap.add_argument("--unroll", type=int, default=1)
  ap.add_argument("--remat", action="store_true")
  ap.add_argument("--attention", default="auto", help="ModelOptions.attention_impl")
  ap.add_argument("--trace-dir", default=None, help="where traces are written (default: a temp dir)")
  ap.add_argument("--phases", default="forward,fwd+bwd,optimizer,train_step,host_pack,generate")
  ap.add_argument("--dump-hlo", default=None, help="write each phase's compiled HLO text here")
  args = ap.parse_args()
  runtime.tune_host_allocator()  # as the trainer's entry points do, before JAX's backend exists
  model = make_model(args.shape, remat=args.remat, unroll=args.unroll, attention=args.attention)
  seqs = make_sequences(args.shape, model.config.vocab_size)
  layout = make_layout(args, seqs)
  b = seqs.rollout
  micro = seqs.micro_batches(np.arange(b.num_rows), layout, pad_id=0)
  real = sum(len(p) + len(r) for p, r in zip(b.prompts, b.response_ids))
  print(f"jax {jax.__version__}; shape {args.shape} {SHAPES[args.shape]}; {b.num_rows} "
        f"sequences ({real} tokens); layout {layout}: {len(micro)} micro-batch(es) of "
        f"{micro[0].rows.input_ids.shape} rows, {micro[0].num_slots} slots; "
        f"unroll={args.unroll} remat={args.remat}")
  fns, lowered = build_phases(model, seqs, layout)
  fns["generate"], lowered["generate"] = build_generate(
      make_model(args.shape, remat=False, unroll=args.unroll))
  wanted = [p for p in args.phases.split(",") if p]
  for p in wanted:
    if p not in fns:
      raise ValueError(f"--phases: unknown phase {p!r}; known {sorted(fns)}")
  times = time_phases({p: fns[p] for p in wanted}, args.reps)
  for p in wanted:
    report_phase(p, lowered[p], fns[p], args, times[p])


if __name__ == "__main__":
  main()
