"""The Stage 3 update on one GPU: tokens/s, MFU and peak memory of Qwen3 shapes (issue 31).

Each (model preset, packed row length, remat) runs in a fresh child process, so that the device's
peak-memory counter starts clean and an out-of-memory stays in its own row. The child builds the
preset with random weights (no download) under the settings of
``configs/stage3_paper.py:disa,qwen3-4b-base,math`` (bf16 compute, f32 parameters, the config's
``attention_chunk``, the layer scan that ``layer_loop='auto'`` picks on a GPU), on a 1-device mesh,
and runs the trainer's update: `update.make_train_step` with the DISA objective and the
clipped AdamW of that config, on one micro-batch of one packed row, as its first update (pi_ref and
pi_old: the initial policy, scored by `scoring.batched.make_scoring_fn`; untimed). The row holds
``row_len / (prompt + response)`` sequences (G = 8 of them share a prompt), with
``max_response_len``-wide per-sequence arrays and ``seqs_per_row`` slots, as the trainer packs
them (`SequenceScores.micro_batches`).

Timed: ``--steps`` updates after ``--warmup`` (the first includes compilation), each to
completion; the median is reported.

FLOPs per update (model FLOPs: the remat recomputation is not counted, nor norms or softmax):
  6 * N * tokens + 12 * L * H * hd * sum_sequences s (s + 1) / 2
N: the matmul parameters (attention and MLP kernels of the L layers plus the vocabulary head; the
embedding lookup is no matmul, a tied head counts once), s: each packed sequence's length (causal
attention inside its segment: s (s + 1) / 2 query-key pairs, 2 matmuls of 2 FLOPs per pair and
head dimension forward, 3x for forward + backward). MFU = FLOPs / seconds / peak, against
``--peak-tflops`` (989: H100 / H200 SXM dense bf16, the datasheet) and against the bf16 matmul
ceiling measured in the same run (``--matmul-size`` cube, random data, median of 20).
Memory: ``jax.devices()[0].memory_stats()['peak_bytes_in_use']`` after the timed steps (the child
sets XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 unless it is set), against `plan_memory.py`'s ``micro``
for the same shape (``--plan FILE``: the lines `plan_memory.py --json` writes; docs/cluster.md has
the command).

Usage: python benchmarks/bench_gpu_train.py [--models qwen3-0.6b,qwen3-1.7b,qwen3-4b-base]
    [--row-lens 8192,16384] [--remat on,off] [--steps 5] [--warmup 2] [--out FILE.jsonl]
Each result is appended to ``--out`` as one JSON line as soon as it exists; a table ends the run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Sequence

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, "benchmarks")):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import plan_memory  # noqa: E402  (benchmarks/: the paper config's Stage 3 settings)
from disa_jax import config as config_lib  # noqa: E402
from disa_jax import parallel  # noqa: E402
from disa_jax.data.packing import PackingLayout  # noqa: E402
from disa_jax.models.config import ModelConfig, get_preset  # noqa: E402
from disa_jax.models.transformer import Transformer  # noqa: E402
from disa_jax.rl import update as rl_update  # noqa: E402
from disa_jax.rl.batch import RolloutBatch, SequenceScores  # noqa: E402
from disa_jax.scoring.batched import make_scoring_fn  # noqa: E402
from disa_jax.rl.update import optimizer_kwargs  # noqa: E402
from disa_jax.scoring.logprobs import gather_responses  # noqa: E402
from disa_jax.workflows import stage3  # noqa: E402
from disa_jax.workflows.stage3_programs import (attention_flops, matmul_params,  # noqa: E402
                                                useful_flops)

SETTINGS_OF = "qwen3-4b-base"  # the paper backbone whose Stage 3 config gives the settings
GROUP = 8  # sequences per prompt (the paper's G)
GIB = 1 << 30
# The remat policy for Qwen3-4B at 16k-token rows on one H200, from the XLA:GPU compile table of
# docs/cluster.md (plan_memory.py --card h200): with cuDNN attention it keeps q, k, v, the
# attention output and the MLP projections: 1.13x the useful FLOPs (full remat: 1.28x) at 120 of
# 141 GiB (full: 89).
REMAT_POLICY = "save_qkv_attn_mlp"


@dataclasses.dataclass(frozen=True)
class Shape:
  """One measured configuration."""
  model: str
  row_len: int
  remat: bool

  @classmethod
  def parse(cls, text: str) -> "Shape":
    """``'qwen3-0.6b:8192:on'`` -> Shape."""
    parts = text.split(":")
    if len(parts) != 3 or parts[2] not in ("on", "off") or not parts[1].isdigit():
      raise SystemExit(f"--one={text!r}: expected MODEL:ROW_LEN:on|off")
    get_preset(parts[0])
    return cls(parts[0], int(parts[1]), parts[2] == "on")

  def __str__(self) -> str:
    return f"{self.model}:{self.row_len}:{'on' if self.remat else 'off'}"


def make_sequences(c: ModelConfig, row_len: int, prompt_len: int, response_len: int, width: int,
                   seed: int = 0):
  """``row_len / (prompt_len + response_len)`` random sequences, G = 8 per prompt, as the
  update's per-sequence `SequenceScores` (responses ``width`` wide, the trainer's max_response_len; each sequence
  a group of one, sampled on-policy with the made-up log-probs as the engine's)."""
  seq = prompt_len + response_len
  if row_len % seq or response_len > width:
    raise SystemExit(f"--prompt-len {prompt_len} + --response-len {response_len} must divide the "
                     f"row length {row_len}, and the response fit max_response_len {width}")
  n = row_len // seq
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(3, c.vocab_size, prompt_len).astype(np.int32)
             for _ in range(-(-n // GROUP))]
  logp = np.where(np.arange(width) < response_len, -1.0, 0.0).astype(np.float32)
  responses = [rng.integers(3, c.vocab_size, response_len).astype(np.int32) for _ in range(n)]
  rollout = RolloutBatch(
      prompt_ids=[str(i) for i in range(n)],
      prompt_tokens=[tuple(int(t) for t in prompts[i // GROUP]) for i in range(n)], group_size=1,
      response_width=width, response_ids=responses, reward=np.zeros(n, np.float32),
      grade_error=np.zeros(n, bool), is_replay=np.zeros(n, bool),
      sampled_logp=[logp[:response_len]] * n, engine_logp=[None] * n, finish_reason=["stop"] * n,
      stored_ref_logp=np.full(n, np.nan))
  return SequenceScores(rollout, signal=rng.normal(size=n).astype(np.float32),
                     old_logp=np.tile(logp, (n, 1)), ref_logp=np.tile(logp, (n, 1)) - 0.1,
                     log_z=rng.normal(size=n).astype(np.float32))


def device_peak_bytes() -> int | None:
  """The device's peak bytes in use so far (None where the backend keeps no statistics: CPU)."""
  stats = jax.devices()[0].memory_stats()
  return None if not stats else int(stats["peak_bytes_in_use"])


def measure(c: ModelConfig, row_len: int, remat: bool, *, prompt_len: int, response_len: int,
            steps: int, warmup: int, attention_impl: str = "auto",
            remat_policy: str = "full") -> dict[str, Any]:
  """Builds the policy and the trainer's update for one packed row and times ``steps`` updates."""
  train, mc = plan_memory.paper_train_config(SETTINGS_OF)
  rc = train.rollout
  seqs = make_sequences(c, row_len, prompt_len, response_len, rc.max_response_len)
  n = seqs.rollout.num_rows
  layout = PackingLayout(row_len=row_len, rows=1, seqs_per_row=max(rc.seqs_per_row, n))
  micro = seqs.micro_batches(np.arange(n), layout, pad_id=0)
  if len(micro) != 1:
    raise RuntimeError(f"expected one micro-batch of one row, the packing gave {len(micro)}")
  seq_lens = [prompt_len + response_len] * n
  if int((micro[0].rows.segment_ids > 0).sum()) != sum(seq_lens):
    raise RuntimeError("the packed row does not hold exactly the sequences' tokens")
  t0 = time.perf_counter()
  # The trainer's model options (max_segments: this layout's sequences per row), not a copy.
  options = stage3.model_options(
      dataclasses.replace(mc, remat=remat, attention_impl=attention_impl,
                          remat_policy=remat_policy),
      dataclasses.replace(rc, seqs_per_row=layout.seqs_per_row), trained=True)
  model = Transformer(c, rngs=nnx.Rngs(0), dtype=jnp.dtype(mc.dtype),
                      param_dtype=jnp.dtype(mc.param_dtype), options=options)
  mesh = parallel.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  parallel.shard_model(model, mesh, parallel.TRAIN_RULES)
  optimizer = rl_update.make_optimizer(train.optim.lr, **optimizer_kwargs(train))
  graphdef, _, state, shardings = rl_update.init_train_state(model, optimizer, mesh=mesh)
  del model  # its arrays are the state's, donated by each update
  update = rl_update.make_train_step(graphdef=graphdef, objective=train.objective,
                                     optimizer=optimizer, mesh=mesh, state_shardings=shardings)
  placed = rl_update.place_micro_batches(micro, mesh)
  # The trainer's first update: pi_ref and pi_old are the initial policy (scored as the trainer
  # does), so the importance weights are 1 and the gradient is not zero.
  score = make_scoring_fn(graphdef)
  placed = [mb.replace(old_logp=lp, ref_logp=lp) for mb in placed
            for lp in [gather_responses(score(state.params, mb.rows), mb.response_index,
                                        mb.response_mask)]]
  jax.block_until_ready((state, placed))
  init_s = time.perf_counter() - t0
  finish = update.lower(state, placed[0])["finish"].compile().memory_analysis()
  print(f"optimizer step compiled: temp {finish.temp_size_in_bytes} B, arguments "
        f"{finish.argument_size_in_bytes} B, outputs {finish.output_size_in_bytes} B",
        file=sys.stderr, flush=True)  # (in the log even when the steps then fail)
  times = []
  for i in range(warmup + steps):
    t0 = time.perf_counter()
    state, metrics = update(state, placed)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
  if not (np.isfinite(loss) and np.isfinite(grad_norm) and grad_norm > 0):
    raise RuntimeError(f"the update's loss is {loss}, its gradient norm {grad_norm}")
  seconds = statistics.median(times[warmup:])
  flops = useful_flops(c, seq_lens)
  return dict(model_params=int(sum(x.size for x in jax.tree.leaves(state.params))),
              matmul_params=matmul_params(c), tokens=sum(seq_lens), sequences=len(seq_lens),
              seq_len=prompt_len + response_len, flops=flops,
              attention_flops=attention_flops(c, seq_lens), init_s=init_s,
              first_step_s=times[0], step_s=seconds, step_s_all=times,
              tokens_per_s=sum(seq_lens) / seconds, tflops=flops / seconds / 1e12,
              peak_bytes=device_peak_bytes(), loss=loss, grad_norm=grad_norm,
              compiled_programs=update.compiled_programs(),
              attention_chunk=mc.attention_chunk, attention_impl=attention_impl,
              remat_policy=remat_policy if remat else None,
              dtype=mc.dtype, param_dtype=mc.param_dtype,
              optimizer_step_temp_bytes=finish.temp_size_in_bytes,
              optimizer_step_argument_bytes=finish.argument_size_in_bytes)


def matmul_ceiling(size: int, reps: int = 20) -> dict[str, Any]:
  """TFLOP/s of a ``size``-cube bf16 matmul on random data (median of ``reps`` after warm-up)."""
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, (size, size), jnp.bfloat16)
  b = jax.random.normal(kb, (size, size), jnp.bfloat16)
  f = jax.jit(lambda x, y: x @ y)
  for _ in range(3):
    f(a, b).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a, b).block_until_ready()
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  return dict(size=size, seconds=seconds, tflops=2 * size ** 3 / seconds / 1e12)


def device_facts() -> dict[str, Any]:
  """What the run ran on: JAX, the device, the driver (nvidia-smi where there is one)."""
  facts = dict(jax=jax.__version__, backend=jax.default_backend(),
               device=jax.devices()[0].device_kind)
  try:
    facts["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=30, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e:
    facts["nvidia_smi"] = f"unavailable: {e}"
  return facts


def child(args: argparse.Namespace) -> None:
  """One measurement in this process; prints ``RESULT <json>``."""
  if args.one == "matmul":
    out = dict(kind="matmul", **matmul_ceiling(args.matmul_size), **device_facts())
  else:
    shape = Shape.parse(args.one)
    out = dict(kind="train", attention_impl=args.attention_impl, **dataclasses.asdict(shape))
    try:
      out.update(measure(get_preset(shape.model), shape.row_len, shape.remat,
                         prompt_len=args.prompt_len, response_len=args.response_len,
                         steps=args.steps, warmup=args.warmup,
                         attention_impl=args.attention_impl, remat_policy=args.remat_policy))
    except Exception as e:  # pylint: disable=broad-except  (an OOM is a result of its row)
      out.update(error=f"{type(e).__name__}: {str(e)[:1500]}", peak_bytes=device_peak_bytes())
  print("RESULT " + json.dumps(out), flush=True)


def run_child(one: str, args: argparse.Namespace) -> dict[str, Any]:
  """Runs ``--one ONE`` in a fresh process; its RESULT line, or the failure's tail."""
  cmd = [sys.executable, os.path.abspath(__file__), "--one", one,
         "--steps", str(args.steps), "--warmup", str(args.warmup),
         "--prompt-len", str(args.prompt_len), "--response-len", str(args.response_len),
         "--matmul-size", str(args.matmul_size), "--attention-impl", args.attention_impl,
         "--remat-policy", args.remat_policy]
  env = dict(os.environ)
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
  t0 = time.perf_counter()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=args.child_timeout)
  except subprocess.TimeoutExpired:
    return dict(kind="error", one=one, error=f"timed out after {args.child_timeout} s")
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      compiled = [x for x in proc.stderr.splitlines() if x.startswith("optimizer step compiled:")]
      return dict(json.loads(line[len("RESULT "):]), wall_s=time.perf_counter() - t0,
                  **({"optimizer_step_compiled": compiled[-1]} if compiled else {}))
  return dict(kind="error", one=one, error=f"exit {proc.returncode}: {proc.stderr[-1500:]}")


def load_plans(path: str | None) -> dict[tuple[str, int, bool], dict[str, Any]]:
  """`plan_memory.py --json` lines keyed by (model, row_len, remat); rows must be 1, fsdp 1."""
  if not path:
    return {}
  plans = {}
  with open(path) as f:
    for n, line in enumerate(f, 1):
      p = json.loads(line)
      if p["rows"] != 1 or p["fsdp"] != 1 or p["remat"] is None:
        raise SystemExit(f"{path}:{n}: a plan of rows=1, fsdp=1 and an explicit --remat/--no-remat "
                         f"is needed, got rows={p['rows']} fsdp={p['fsdp']} remat={p['remat']}")
      plans[p["model"], p["row_len"], p["remat"]] = p
  return plans


def table(results: Sequence[dict[str, Any]], peak_tflops: float,
          plans: dict[tuple[str, int, bool], dict[str, Any]]) -> str:
  """The printed table: one line per configuration."""
  ceiling = max((r["tflops"] for r in results if r["kind"] == "matmul"), default=None)
  lines = [f"{'model':14s} {'row':>6s} {'remat':>5s} {'step s':>7s} {'tok/s':>8s} {'TFLOP/s':>8s} "
           f"{'MFU':>6s} {'MFU/mm':>6s} {'peak GiB':>8s} {'plan GiB':>8s}  note"]
  for r in results:
    if r["kind"] != "train":
      continue
    plan = plans.get((r["model"], r["row_len"], r["remat"]))
    plan_gib = f"{plan['micro'] / GIB:8.2f}" if plan else f"{'-':>8s}"
    peak = f"{r['peak_bytes'] / GIB:8.2f}" if r.get("peak_bytes") else f"{'-':>8s}"
    head = f"{r['model']:14s} {r['row_len']:6d} {'on' if r['remat'] else 'off':>5s} "
    if "error" in r:
      lines.append(head + f"{'-':>7s} {'-':>8s} {'-':>8s} {'-':>6s} {'-':>6s} {peak} {plan_gib}  "
                   + r["error"].splitlines()[0][:100])
      continue
    mfu_mm = f"{r['tflops'] / ceiling:6.1%}" if ceiling else f"{'-':>6s}"
    lines.append(head + f"{r['step_s']:7.3f} {r['tokens_per_s']:8.0f} {r['tflops']:8.1f} "
                 f"{r['tflops'] / peak_tflops:6.1%} {mfu_mm} {peak} {plan_gib}")
  return "\n".join(lines)


def row_scaling(results: Sequence[dict[str, Any]]) -> list[str]:
  """For each (model, remat, sequence length), each row length against the next shorter one:
  tokens and step time multiply by what? With the sequences' length fixed, the model FLOPs grow
  with the tokens; a step time growing faster is work quadratic in the row length (attention
  computed across the whole packed row, the pairs between sequences masked after computing)."""
  groups: dict[tuple[str, bool, int], dict[int, dict[str, Any]]] = {}
  for r in results:
    if r["kind"] == "train" and "error" not in r:
      groups.setdefault((r["model"], r["remat"], r["seq_len"]), {})[r["row_len"]] = r
  lines = []
  for (model, remat, seq_len), rows in sorted(groups.items()):
    lens = sorted(rows)
    for short, long in zip(lens, lens[1:]):
      lines.append(f"{model:14s} remat {'on' if remat else 'off':3s} sequences of {seq_len}: row "
                   f"{short} -> {long}: tokens x{long / short:.1f}, step time "
                   f"x{rows[long]['step_s'] / rows[short]['step_s']:.2f}")
  return lines


def read_results(paths: Sequence[str]) -> list[dict[str, Any]]:
  """The JSON lines of earlier runs (``--out`` files)."""
  results = []
  for path in paths:
    with open(path) as f:
      results += [json.loads(line) for line in f if line.strip()]
  return results


def print_report(results: Sequence[dict[str, Any]], args: argparse.Namespace,
                 plans: dict[tuple[str, int, bool], dict[str, Any]]) -> None:
  print(f"\nMFU against {args.peak_tflops:g} TFLOP/s (datasheet) and, MFU/mm, against the best "
        "measured bf16 matmul; FLOPs = 6 N tokens + 12 L H hd sum s(s+1)/2; plan GiB: "
        "plan_memory's micro (+adam)")
  print(table(results, args.peak_tflops, plans))
  scaling = row_scaling(results)
  if scaling:
    print("\nrow length scaling at a fixed sequence length:")
    print("\n".join(scaling))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--models", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b-base")
  ap.add_argument("--row-lens", default="8192,16384")
  ap.add_argument("--remat", default="on,off", help="'on', 'off' or 'on,off'")
  ap.add_argument("--steps", type=int, default=5, help="timed updates")
  ap.add_argument("--warmup", type=int, default=2, help="untimed updates first (compilation)")
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--response-len", type=int, default=1792)
  ap.add_argument("--matmul-size", type=int, default=8192)
  ap.add_argument("--attention-impl", default="auto",
                  help="the model's attention_impl (disa_jax/models/attention_dispatch.py)")
  ap.add_argument("--remat-policy", default=REMAT_POLICY, choices=config_lib.REMAT_POLICIES,
                  help="what a rematerialised layer keeps (with --remat on)")
  ap.add_argument("--no-matmul", action="store_true", help="skip the matmul ceiling")
  ap.add_argument("--peak-tflops", type=float, default=989.0, help="datasheet bf16 dense peak")
  ap.add_argument("--child-timeout", type=float, default=600.0)
  ap.add_argument("--plan", default=None, help="plan_memory.py --json output(s), comma-separated")
  ap.add_argument("--out", default=None, help="append each result as a JSON line here")
  ap.add_argument("--report", default=None,
                  help="measure nothing: print the tables of these --out files (comma-separated)")
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.steps < 1 or args.warmup < 1:
    raise SystemExit(f"--steps={args.steps} and --warmup={args.warmup} must be >= 1")
  return args


def main(argv: Sequence[str] | None = None) -> None:
  args = parse_args(argv)
  if args.one:
    child(args)
    return
  plans = {}
  for path in (args.plan or "").split(","):
    plans.update(load_plans(path.strip() or None))
  if args.report:
    print_report(read_results(args.report.split(",")), args, plans)
    return
  shapes = [Shape.parse(f"{m}:{n}:{r}") for m in args.models.split(",")
            for r in args.remat.split(",") for n in args.row_lens.split(",")]
  jobs = ([] if args.no_matmul else ["matmul"]) + [str(s) for s in shapes]
  results = []
  for one in jobs:
    results.append(run_child(one, args))
    print(f"{one}: {json.dumps(results[-1])}", flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write(json.dumps(results[-1]) + "\n")
  print_report(results, args, plans)


if __name__ == "__main__":
  main()
