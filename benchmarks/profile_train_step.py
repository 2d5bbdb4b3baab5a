"""Where the Stage 3 update's time goes: per-op profile of forward, forward+backward and the update.

Shapes (``--shape``):
- ``peer``: the TRL bench's tiny Qwen3 (vocab 113, d=128, mlp 256, 2 layers, 4 heads / 2 kv heads,
  head_dim 32, untied) on its GRPO batch: 64 rows x 32 columns (18-19 prompt tokens, 1-8 response
  tokens, right padding to a multiple of 16, as the trainer packs it);
- ``d512``: `bench_models_speed.py`'s Qwen3 (vocab 32,000, d=512, 4 layers) on 8 x 512 real tokens.

Phases, each a separate jitted function on the same parameters and batch:
- ``forward``: `scoring.token_logprobs` (no gradient);
- ``fwd+bwd``: value and gradient of a GRPO-like token loss through `token_logprobs`;
- ``optimizer``: the trainer's optimizer (clip by global norm + AdamW) on given gradients;
- ``train_step``: the trainer's jitted update (`disa_jax.rl.train_step.make_train_step`, GRPO, one
  on-policy mini-batch, a 1-device mesh and the model's sharding constraints, as in the TRL bench);
- ``generate``: `JaxSampler.generate` in this process (8 prompts x 8 samples of at most 8 new
  tokens at temperature 1 on the peer shape; host packing and unpacking included; no HLO counts).

For each phase it prints: wall time (median, min-max over alternating repetitions), the compiled
HLO's instruction counts (fusions, dots, copies, transposes, scatters, gathers, while loops, ...),
and the thunks that take the time (from a `jax.profiler` trace: microseconds per call summed over
threads, call count, share, and what a fusion contains).

    python benchmarks/profile_train_step.py [--shape peer|d512] [--reps 20] [--top 15]
        [--chunk N] [--unroll 1] [--remat] [--trace-dir DIR] [--phases forward,fwd+bwd,...]
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

from disa_jax import models, parallel, scoring
from disa_jax.estimators import RewardTransform
from disa_jax.rl import train_step as ts
from disa_jax.rl.config import LossCfg

SHAPES = {
    "peer": dict(vocab_size=113, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, rope_theta=10000.0),
    "d512": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=64, rope_theta=1_000_000.0),
}
# Opcodes counted in the compiled module (all computations, fused ones included).
_COUNTED = ("fusion", "dot", "convolution", "custom-call", "copy", "transpose", "scatter", "gather",
            "while", "reduce-window", "dynamic-slice", "dynamic-update-slice", "sort", "call")


def make_model(shape: str, *, remat: bool, unroll: int) -> models.Transformer:
  """The `shape`'s Qwen3 with random weights (std 0.02), float32."""
  config = models.ModelConfig(family="qwen3", qk_norm=True, tie_word_embeddings=False,
                              **SHAPES[shape])
  return models.Transformer(config, rngs=nnx.Rngs(0), remat=remat, scan_unroll=unroll)


def make_batch(shape: str, vocab: int) -> dict[str, np.ndarray]:
  """A packed GRPO batch `[B, T]` (+ `[B]` row fields) with the trainer's layout and padding."""
  rng = np.random.default_rng(0)
  if shape == "peer":
    b, t = 64, 32
    plen = rng.integers(18, 20, b)
    rlen = rng.integers(1, 9, b)
  else:
    b, t = 8, 512
    plen = np.full(b, 256)
    rlen = np.full(b, 256)
  cols = np.arange(t)[None]
  attn = (cols < (plen + rlen)[:, None]).astype(np.int32)
  resp = ((cols >= plen[:, None]) & (attn > 0)).astype(np.float32)
  return {
      "input_ids": rng.integers(0, vocab, (b, t)).astype(np.int32),
      "attention_mask": attn,
      "prompt_mask": (cols < plen[:, None]).astype(np.float32),
      "response_mask": resp,
      "old_logp": np.zeros((b, t), np.float32),
      "ref_logp": np.zeros((b, t), np.float32),
      "reward": np.zeros(b, np.float32),
      "advantage": rng.normal(size=b).astype(np.float32),
      "log_z": np.zeros(b, np.float32),
  }


def build_phases(model: models.Transformer, batch: dict[str, np.ndarray], chunk: int | None
                 ) -> dict[str, Callable[[], Any]]:
  """name -> zero-argument callable running one jitted phase (outputs not donated)."""
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  parallel.shard_model(model, mesh, parallel.TRAIN_RULES)
  kw = {} if chunk is None else {"chunk_size": chunk}
  logprob_fn = lambda m, ids, attn: scoring.token_logprobs(m, ids, attn, **kw)
  optimizer = ts.make_optimizer(1e-4, weight_decay=0.0, grad_clip=1.0)
  graphdef, _, state, shardings = ts.init_train_state(model, optimizer, mesh=mesh)
  params = state.params
  ids, attn = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"])
  resp, adv = jnp.asarray(batch["response_mask"]), jnp.asarray(batch["advantage"])

  def loss(p):
    lp = logprob_fn(nnx.merge(graphdef, p), ids, attn)
    return -jnp.sum(jnp.exp(lp - jax.lax.stop_gradient(lp)) * adv[:, None] * resp) / resp.sum()

  forward = jax.jit(lambda p: logprob_fn(nnx.merge(graphdef, p), ids, attn))
  fwd_bwd = jax.jit(jax.value_and_grad(loss))
  grads = jax.tree.map(lambda x: jnp.full_like(x, 1e-3), params)

  @jax.jit
  def opt(p, o, g):
    updates, o = optimizer.update(g, o, p)
    return ts.optax.apply_updates(p, updates), o

  loss_cfg = LossCfg(method="grpo", beta=1.0, length_normalize=False,
                     reward_transform=RewardTransform("raw"), omega_mode="one", eps_low=0.2,
                     eps_high=0.2)
  update = ts.make_train_step(graphdef, loss_cfg, optimizer, logprob_fn=logprob_fn, mesh=mesh,
                              state_shardings=shardings, donate=False, on_policy_old_logp=True,
                              use_ref=False)
  micro = {k: jnp.asarray(v)[None] for k, v in batch.items()}  # [B, ...] -> [K=1, B, ...]
  return {
      "forward": lambda: forward(params),
      "fwd+bwd": lambda: fwd_bwd(params),
      "optimizer": lambda: opt(params, state.opt_state, grads),
      "train_step": lambda: update(state, micro),
  }, {
      "forward": lambda: forward.lower(params),
      "fwd+bwd": lambda: fwd_bwd.lower(params),
      "optimizer": lambda: opt.lower(params, state.opt_state, grads),
      "train_step": lambda: update.lower(state, micro),
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
  (num_new, jitted), = sampler._fns.items()  # pylint: disable=protected-access
  recorded = []

  def recording(*a):
    recorded[:] = a
    return jitted(*a)

  sampler._fns[num_new] = recording  # pylint: disable=protected-access
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
  by_kind: collections.Counter = collections.Counter()
  for k, (us, _) in prof.items():
    by_kind[_kind(desc.get(k, k))] += us
  print("  by kind (ms/call): " + ", ".join(f"{k} {v / 1e3:.2f}" for k, v in by_kind.most_common()))
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
  ap.add_argument("--chunk", type=int, default=None, help="token_logprobs chunk_size (default: its own)")
  ap.add_argument("--unroll", type=int, default=1)
  ap.add_argument("--remat", action="store_true")
  ap.add_argument("--trace-dir", default=None, help="where traces are written (default: a temp dir)")
  ap.add_argument("--phases", default="forward,fwd+bwd,optimizer,train_step,generate")
  ap.add_argument("--dump-hlo", default=None, help="write each phase's compiled HLO text here")
  args = ap.parse_args()
  model = make_model(args.shape, remat=args.remat, unroll=args.unroll)
  batch = make_batch(args.shape, model.config.vocab_size)
  print(f"jax {jax.__version__}; shape {args.shape} {SHAPES[args.shape]}; batch "
        f"{batch['input_ids'].shape} ({int(batch['attention_mask'].sum())} real tokens); "
        f"chunk={args.chunk} unroll={args.unroll} remat={args.remat}")
  fns, lowered = build_phases(model, batch, args.chunk)
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
