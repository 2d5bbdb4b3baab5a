"""Speed of our Flax decoder vs `transformers` PyTorch eager on the same Qwen3 weights.

Shapes (``--shape``):
- ``d512``: Qwen3, d=512, 4 layers, 8 heads (4 kv), head_dim 64, mlp 1536, vocab 32,000, untied;
  batch 8 x seq 512 = 4,096 tokens;
- ``peer``: the TRL bench's tiny Qwen3 (vocab 113, d=128, mlp 256, 2 layers, 4 heads / 2 kv,
  head_dim 32, untied) on its GRPO batch size, 64 x 32 = 2,048 tokens.
The torch model is made by `transformers`, its weights are copied into ours via
`load_hf_state_dict`, and logits are checked to agree before timing.

Measured, alternating ours (before) / ours (after) / torch within each repetition:
- scoring: teacher-forced per-token log-probs of the batch (no gradient);
- train step: forward + backward + AdamW update of a mean token NLL loss.
"before" is the code path of the models before issue 14: the decoder layers as a `lax.scan`
(`layer_loop='scan'`), the log-probs in 1,024-row chunks under `jax.checkpoint` (the backward
recomputes each chunk's logits), the attention in one block, and the projections, RMSNorm, RoPE and
the attention core differentiated by autodiff (their custom-VJP functions swapped for their values
while tracing, `_autodiff_backward`); only the gathered target pick (it replaced a one-hot select)
is not switchable. "after" uses the defaults.
Reported: tokens/s medians and the median (min-max) of the per-repetition ratios.

Usage: python benchmarks/bench_models_speed.py [--shape d512|peer] [--reps 7] [--unroll 1] [--remat]
       [--chunk N] [--dtype float32|bfloat16] [--glibc-defaults] [--torch-threads N]
The process first applies `disa_jax.runtime.tune_host_allocator`, as every launch entry point does
(glibc keeps XLA:CPU's per-execution scratch block instead of mapping it fresh and faulting its
pages in on every call); both models run under it. ``--glibc-defaults`` leaves glibc's defaults.
XLA_FLAGS=--xla_cpu_experimental_onednn_custom_call=true (oneDNN matmuls) did not help with
jax 0.10.2: d512 train step ours/torch 1.01x with it, 0.99x without (3 reps each); no change on
the peer shape either.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from flax import nnx

from disa_jax import models, runtime, scoring
from disa_jax.models import attention, layers
from disa_jax.scoring import head as head_lib
from disa_jax.scoring import logprobs as logprobs_lib

SHAPES = {  # (batch, seq, transformers.Qwen3Config kwargs)
    "d512": (8, 512, dict(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=64, max_position_embeddings=2048, rope_theta=1_000_000.0)),
    "peer": (64, 32, dict(vocab_size=113, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, max_position_embeddings=128, rope_theta=10000.0)),
}


def make_torch_model(shape: str) -> transformers.PreTrainedModel:
  torch.manual_seed(0)
  config = transformers.Qwen3Config(tie_word_embeddings=False, **SHAPES[shape][2])
  return transformers.AutoModelForCausalLM.from_config(
      config, dtype=torch.float32, attn_implementation="sdpa")


def torch_logprobs(model, ids, mask):
  logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
  logp = torch.log_softmax(logits, dim=-1)
  return torch.gather(logp, -1, ids[:, 1:, None])[..., 0] * (mask[:, 1:] * mask[:, :-1])


def _parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser()
  parser.add_argument("--shape", choices=sorted(SHAPES), default="d512")
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--unroll", type=int, default=1)
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--chunk", type=int, default=None, help="after: chunk_size (default: by V)")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--glibc-defaults", action="store_true",
                      help="skip runtime.tune_host_allocator (see doc)")
  parser.add_argument("--torch-threads", type=int, default=0,
                      help="torch.set_num_threads (0: torch's default; 1 resists a loaded machine)")
  return parser.parse_args()


def _checkpointed_head(rows, targets, kernel, save_logits):
  """"before"'s head: autodiff of the chunk's log-probs under `jax.checkpoint` in a scan (the
  backward pass recomputes every chunk's logits whatever their size)."""
  del save_logits
  chunk = jax.checkpoint(lambda h, tgt: head_lib._chunk_forward(h, tgt, kernel)[0])
  return jax.lax.scan(lambda carry, xs: (carry, chunk(*xs)), None, (rows, targets))[1]


@contextlib.contextmanager
def _autodiff_backward(active: bool):
  """While tracing "before": projections, RMSNorm, RoPE and the attention core differentiated by
  autodiff of their values (each custom-VJP function's undecorated `fun`), the attention in one
  block (no causal blocks), and the head's checkpointed chunks (`_checkpointed_head`)."""
  saved = (layers.dense, layers.rms_norm, layers.apply_rope, attention._attend,
           attention.MAX_CAUSAL_BLOCKS, logprobs_lib.target_logprobs)
  if active:
    layers.dense, layers.rms_norm, layers.apply_rope = (f.fun for f in saved[:3])
    attention._attend, attention.MAX_CAUSAL_BLOCKS = saved[3].fun, 1
    logprobs_lib.target_logprobs = _checkpointed_head
  try:
    yield
  finally:
    (layers.dense, layers.rms_norm, layers.apply_rope, attention._attend,
     attention.MAX_CAUSAL_BLOCKS, logprobs_lib.target_logprobs) = saved


def _ours(tmodel, args, dtype, ids, mask, before: bool):
  """(score, train) closures of our model; `before`: the pre-issue-14 layer loop and chunking."""
  config = models.ModelConfig.from_hf_config(tmodel.config.to_dict())
  model = models.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                             options=models.ModelOptions(
                                 remat=args.remat, scan_unroll=args.unroll,
                                 layer_loop="scan" if before else "auto"))
  models.load_hf_state_dict(model, {k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
  chunk = 1024 if before else args.chunk
  graphdef, params = nnx.split(model)

  def score(params, ids, mask):
    return scoring.token_logprobs(nnx.merge(graphdef, params), ids, mask, chunk_size=chunk)

  def loss_fn(params, ids, mask):
    lp = scoring.token_logprobs(nnx.merge(graphdef, params), ids, mask, chunk_size=chunk)
    return -jnp.sum(lp) / jnp.sum(mask[:, 1:])

  tx = optax.adamw(1e-4)
  state = {"params": params, "opt": tx.init(params)}

  def train_step(params, opt_state, ids, mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  with _autodiff_backward(before):  # compiled now, so that "before" keeps autodiff
    score = jax.jit(score).lower(params, ids, mask).compile()
    train_step = jax.jit(train_step).lower(params, state["opt"], ids, mask).compile()

  def train():
    state["params"], state["opt"], loss = train_step(state["params"], state["opt"], ids, mask)
    jax.block_until_ready(loss)

  return (lambda: jax.block_until_ready(score(state["params"], ids, mask))), train


def main() -> None:
  args = _parse_args()
  tuned = False if args.glibc_defaults else runtime.tune_host_allocator()  # before JAX's backend
  if args.torch_threads > 0:
    torch.set_num_threads(args.torch_threads)
  dtype = jnp.dtype(args.dtype)
  b, t = SHAPES[args.shape][:2]
  print(f"jax {jax.__version__} devices={jax.devices()} torch {torch.__version__} "
        f"threads={torch.get_num_threads()} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} "
        f"allocator tuned={tuned} load={os.getloadavg()[0]:.1f}")
  print(f"shape {args.shape}: batch {b} x {t}, {SHAPES[args.shape][2]}")
  print(f"ours: dtype={args.dtype} scan_unroll={args.unroll} remat={args.remat} chunk={args.chunk}")

  tmodel = make_torch_model(args.shape)
  rng = np.random.default_rng(0)
  vocab = SHAPES[args.shape][2]["vocab_size"]
  ids_np = rng.integers(0, vocab, size=(b, t)).astype(np.int64)
  mask_np = np.ones((b, t), np.int64)
  ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
  tids, tmask = torch.tensor(ids_np), torch.tensor(mask_np)
  fns = {}
  for name, before in (("before", True), ("after", False)):
    fns[f"score_{name}"], fns[f"train_{name}"] = _ours(tmodel, args, dtype, ids, mask, before)
  topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-4)

  def torch_train():
    topt.zero_grad(set_to_none=True)
    loss = -torch_logprobs(tmodel, tids, tmask).sum() / tmask[:, 1:].sum()
    loss.backward()
    topt.step()

  def torch_score():
    with torch.inference_mode():
      torch_logprobs(tmodel, tids, tmask)

  fns["score_torch"], fns["train_torch"] = torch_score, torch_train
  _check_and_warm(fns, tmodel, tids, tmask, args, dtype, ids, mask)
  res = {k: [] for k in fns}
  for rep in range(args.reps):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      fn()
      res[k].append(time.perf_counter() - t0)
    print(f"rep {rep}: " + "  ".join(f"{k}={v[-1]:.3f}s" for k, v in res.items()), flush=True)
  _report(res, b * t)


def _check_and_warm(fns, tmodel, tids, tmask, args, dtype, ids, mask) -> None:
  """Checks our log-probs against torch's (before and after paths), then compiles everything."""
  with torch.inference_mode():
    ref = torch_logprobs(tmodel, tids, tmask).numpy()
  for name, before in (("before", True), ("after", False)):
    config = models.ModelConfig.from_hf_config(tmodel.config.to_dict())
    model = models.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, options=models.ModelOptions(
        layer_loop="scan" if before else "auto"))
    models.load_hf_state_dict(model, {k: v.detach().numpy() for k, v in tmodel.state_dict().items()})
    got = np.asarray(scoring.token_logprobs(model, ids, mask, chunk_size=1024 if before else args.chunk))
    print(f"max |logprob ours ({name}) - torch| = {np.abs(got[:, 1:] - ref).max():.2e}")
  t0 = time.perf_counter()
  for fn in fns.values():
    fn()
  print(f"compile + first runs {time.perf_counter() - t0:.1f}s")


def _report(res: dict[str, list[float]], tokens: int) -> None:
  for what in ("score", "train"):
    t = np.array(res[f"{what}_torch"])
    line = f"{what:6s} tokens/s: torch {tokens / np.median(t):8.0f}"
    for name in ("before", "after"):
      o = np.array(res[f"{what}_{name}"])
      ratios = t / o  # ours tokens/s over torch tokens/s
      line += (f" | ours {name} {tokens / np.median(o):8.0f}, ours/torch "
               f"{statistics.median(ratios):.2f}x ({ratios.min():.2f}-{ratios.max():.2f})")
    gain = np.array(res[f"{what}_before"]) / np.array(res[f"{what}_after"])
    print(line + f" | after/before {statistics.median(gain):.2f}x ({gain.min():.2f}-{gain.max():.2f})")
  print(f"over {len(res['train_torch'])} alternating reps; load average now {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
