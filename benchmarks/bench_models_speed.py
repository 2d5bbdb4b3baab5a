"""Speed of our Flax decoder vs `transformers` PyTorch eager on the same tiny-but-real Qwen3.

Config: Qwen3, d=512, 4 layers, 8 heads (4 kv), head_dim 64, mlp 1536, vocab 32,000, untied;
batch 8 x seq 512 = 4,096 tokens. The torch model is made by `transformers`, its weights are
copied into ours via `load_hf_state_dict`, and logits are checked to agree before timing.

Measured, alternating ours / torch within each repetition:
- scoring: teacher-forced per-token log-probs of the batch (no gradient);
- train step: forward + backward + AdamW update of a mean token NLL loss.
Reported: tokens/s medians and the median (min-max) of the per-repetition ratio ours/torch.

Usage: python benchmarks/bench_models_speed.py [--reps 7] [--unroll 1] [--remat] [--chunk 1024]
       [--dtype float32|bfloat16]
Faster on this CPU: XLA_FLAGS=--xla_cpu_experimental_onednn_custom_call=true (oneDNN matmuls; ~20%
faster train step here, mostly in the vocabulary projection).
"""

from __future__ import annotations

import argparse
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

from disa_jax import models, scoring

B, T = 8, 512


def make_torch_model() -> transformers.PreTrainedModel:
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
      tie_word_embeddings=False, rope_theta=1_000_000.0)
  return transformers.AutoModelForCausalLM.from_config(
      config, dtype=torch.float32, attn_implementation="sdpa")


def torch_logprobs(model, ids, mask):
  logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
  logp = torch.log_softmax(logits, dim=-1)
  return torch.gather(logp, -1, ids[:, 1:, None])[..., 0] * (mask[:, 1:] * mask[:, :-1])


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--unroll", type=int, default=1)
  parser.add_argument("--remat", action="store_true")
  parser.add_argument("--chunk", type=int, default=1024)
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  print(f"jax {jax.__version__} devices={jax.devices()} torch {torch.__version__} "
        f"threads={torch.get_num_threads()} XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"ours: dtype={args.dtype} scan_unroll={args.unroll} remat={args.remat} chunk={args.chunk}")

  tmodel = make_torch_model()
  config = models.ModelConfig.from_hf_config(tmodel.config.to_dict())
  ours = models.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=jnp.float32,
                            remat=args.remat, scan_unroll=args.unroll)
  models.load_hf_state_dict(ours, {k: v.detach().numpy() for k, v in tmodel.state_dict().items()})

  rng = np.random.default_rng(0)
  ids_np = rng.integers(0, 32000, size=(B, T)).astype(np.int64)
  mask_np = np.ones((B, T), np.int64)
  ids, mask = jnp.asarray(ids_np, jnp.int32), jnp.asarray(mask_np, jnp.int32)
  tids, tmask = torch.tensor(ids_np), torch.tensor(mask_np)

  graphdef, params = nnx.split(ours)

  @jax.jit
  def score(params, ids, mask):
    return scoring.token_logprobs(nnx.merge(graphdef, params), ids, mask, chunk_size=args.chunk)

  def loss_fn(params, ids, mask):
    lp = scoring.token_logprobs(nnx.merge(graphdef, params), ids, mask, chunk_size=args.chunk)
    return -jnp.sum(lp) / jnp.sum(mask[:, 1:])

  tx = optax.adamw(1e-4)
  opt_state = tx.init(params)

  @jax.jit
  def train_step(params, opt_state, ids, mask):
    loss, grads = jax.value_and_grad(loss_fn)(params, ids, mask)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-4)

  def torch_train():
    topt.zero_grad(set_to_none=True)
    loss = -torch_logprobs(tmodel, tids, tmask).sum() / tmask[:, 1:].sum()
    loss.backward()
    topt.step()
    return loss

  # correctness and warm-up (compilation)
  with torch.inference_mode():
    ref = torch_logprobs(tmodel, tids, tmask).numpy()
  got = np.asarray(score(params, ids, mask))[:, 1:]
  print(f"max |logprob ours - torch| = {np.abs(got - ref).max():.2e}")
  t0 = time.perf_counter()
  jax.block_until_ready(train_step(params, opt_state, ids, mask))
  print(f"train-step compile+first run {time.perf_counter() - t0:.1f}s")
  torch_train()

  def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

  res = {k: [] for k in ("score_ours", "score_torch", "train_ours", "train_torch")}
  for rep in range(args.reps):
    res["score_ours"].append(timed(lambda: jax.block_until_ready(score(params, ids, mask))))
    with torch.inference_mode():
      res["score_torch"].append(timed(lambda: torch_logprobs(tmodel, tids, tmask)))

    def ours_train():
      nonlocal params, opt_state
      params, opt_state, loss = train_step(params, opt_state, ids, mask)
      jax.block_until_ready(loss)

    res["train_ours"].append(timed(ours_train))
    res["train_torch"].append(timed(torch_train))
    print(f"rep {rep}: " + "  ".join(f"{k}={v[-1]:.3f}s" for k, v in res.items()), flush=True)

  tokens = B * T
  for what in ("score", "train"):
    o, t = np.array(res[f"{what}_ours"]), np.array(res[f"{what}_torch"])
    ratios = t / o  # ours tokens/s over torch tokens/s
    print(f"{what:6s} tokens/s: ours {tokens / np.median(o):8.0f}  "
          f"torch {tokens / np.median(t):8.0f}"
          f"   ratio ours/torch median {statistics.median(ratios):.2f}x "
          f"(min {ratios.min():.2f} - max {ratios.max():.2f}) over {len(o)} alternating reps")


if __name__ == "__main__":
  main()
