"""Shared helpers for the Stage 3 tests: a reference log-prob function and synthetic sequences."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from disa_jax.data.packing import PackingLayout
from disa_jax.rl.batch import RolloutBatch, SequenceScores


# Made-up scored sequences, per sequence (`SequenceScores`).
Sequences = SequenceScores


def naive_token_logprobs(model, input_ids, attention_mask):
  """out[:, t] = log p(ids[t] | ids[<t]) from full float32 logits (reference implementation)."""
  logits = model(input_ids, attention_mask=attention_mask).astype(jnp.float32)  # [B, T, V]
  lp = jax.nn.log_softmax(logits[:, :-1], axis=-1)  # predicts tokens 1..T-1
  tok = jnp.take_along_axis(lp, input_ids[:, 1:, None], axis=-1)[..., 0]  # [B, T-1]
  valid = (attention_mask[:, 1:] > 0) & (attention_mask[:, :-1] > 0)
  tok = jnp.where(valid, tok, 0.0)
  return jnp.pad(tok, ((0, 0), (1, 0)))  # [B, T], zero at t = 0


def scored_sequences(prompts, responses, old_logp, ref_logp, signal, log_z) -> Sequences:
  """Made-up (prompt, response) sequences as `Sequences`: each sequence a group of
  one (its own prompt), sampled on-policy with ``old_logp`` as the engine's log-probs (``[N, W]``
  per response token; ``[N]`` signal and log Z)."""
  n, width = np.shape(old_logp)
  rollout = RolloutBatch(
      prompt_ids=[f"s{i}" for i in range(n)],
      prompt_tokens=[tuple(int(t) for t in p) for p in prompts], group_size=1,
      response_width=width, response_ids=[np.asarray(r, np.int32) for r in responses],
      reward=np.zeros(n, np.float32), grade_error=np.zeros(n, bool), is_replay=np.zeros(n, bool),
      sampled_logp=[old_logp[i, :len(r)] for i, r in enumerate(responses)],
      engine_logp=[None] * n, finish_reason=["stop"] * n, stored_ref_logp=np.full(n, np.nan))
  return Sequences(rollout, signal=signal, ref_logp=ref_logp, old_logp=old_logp, log_z=log_z)


def synthetic_sequences(seed, n, max_prompt, max_response, vocab, group_size=4, invalid_rows=0,
                        lengths=None):
  """``n`` prompt-major (prompt, response) sequences as `Sequences` with made-up log-probs,
  signals and log Z (`scored_sequences`); the last ``invalid_rows`` have empty responses.
  ``lengths``: optional ``[(prompt_len, response_len)]`` instead of random ones."""
  rng = np.random.default_rng(seed)
  if lengths is None:
    lengths = list(zip(rng.integers(1, max_prompt + 1, n).tolist(),
                       rng.integers(1, max_response + 1, n).tolist()))
  lengths = [(p, 0 if i >= n - invalid_rows else r) for i, (p, r) in enumerate(lengths)]
  prompts = [rng.integers(3, vocab, p).astype(np.int32) for p, _ in lengths]
  responses = [rng.integers(3, vocab, r).astype(np.int32) for _, r in lengths]
  mask = np.arange(max_response)[None] < np.asarray([r for _, r in lengths])[:, None]
  old = (-rng.uniform(3.5, 5.5, (n, max_response)) * mask).astype(np.float32)
  ref = (-rng.uniform(3.5, 5.5, (n, max_response)) * mask).astype(np.float32)
  reward = rng.integers(0, 2, n).astype(np.float32)
  grouped = reward.reshape(-1, group_size)  # [B] -> [P, G]
  adv = ((grouped - grouped.mean(-1, keepdims=True)) /
         (grouped.std(-1, keepdims=True) + 1e-6)).reshape(-1)  # [P, G] -> [B]
  log_z = np.repeat(rng.normal(-4.0, 1.0, n // group_size), group_size).astype(np.float32)
  return scored_sequences(prompts, responses, old, ref, adv.astype(np.float32), log_z)


def padded_layout(rows, row_len=0, pad_to=4):
  """Today's padding as a layout: one sequence per row, ``rows`` rows per micro-batch."""
  return PackingLayout(packing=False, row_len=row_len, rows=rows, pad_to=pad_to)


def packed_layout(rows, row_len, seqs_per_row=8, share_prompts=False):
  return PackingLayout(row_len=row_len, rows=rows, seqs_per_row=seqs_per_row,
                       share_prompts=share_prompts)


def micro_batches(seqs, layout, idx=None):
  """All of ``seqs`` (or ``idx``) as one mini-batch's micro-batches of ``layout`` (pad id 0)."""
  idx = np.arange(seqs.rollout.num_rows) if idx is None else idx
  return seqs.micro_batches(idx, layout, pad_id=0)


def alone_response_logp(model, scored):
  """``[N, W]`` log-probs of each response token, each sequence scored alone (no padding)."""
  b = scored.rollout
  out = np.zeros((b.num_rows, b.response_width), np.float32)
  for i, (p, r) in enumerate(zip(b.prompts, b.response_ids)):
    ids = jnp.asarray(np.concatenate([p, r])[None])
    lp = np.asarray(naive_token_logprobs(model, ids, jnp.ones_like(ids)))[0]
    out[i, :len(r)] = lp[len(p):]
  return out


def grouped_sequences(seed, groups, max_response, vocab):
  """Prompt-major sequences (`Sequences`) whose groups share their prompt tokens (shared-prompt
  packing).

  Args:
    seed: the RNG seed.
    groups: ``[(prompt_len, [response_len, ...]), ...]``, one entry per prompt.
    max_response: W.
    vocab: token ids are drawn from ``[3, vocab)``.
  """
  rng = np.random.default_rng(seed)
  prompts, responses, log_z, adv = [], [], [], []
  for prompt_len, lengths in groups:
    p = rng.integers(3, vocab, prompt_len).astype(np.int32)
    prompts += [p] * len(lengths)
    responses += [rng.integers(3, vocab, r).astype(np.int32) for r in lengths]
    reward = rng.integers(0, 2, len(lengths)).astype(np.float32)
    adv += list((reward - reward.mean()) / (reward.std() + 1e-6))
    log_z += [rng.normal(-4.0, 1.0)] * len(lengths)
  n = len(prompts)
  mask = np.arange(max_response)[None] < np.asarray([len(r) for r in responses])[:, None]
  old = (-rng.uniform(3.5, 5.5, (n, max_response)) * mask).astype(np.float32)
  ref = (-rng.uniform(3.5, 5.5, (n, max_response)) * mask).astype(np.float32)
  return scored_sequences(prompts, responses, old, ref, np.asarray(adv, np.float32),
                          np.asarray(log_z, np.float32))


def shared_layout(rows, row_len, seqs_per_row=8):
  return packed_layout(rows, row_len, seqs_per_row, share_prompts=True)


# The CPU's vector extensions XLA:CPU compiles for (/proc/cpuinfo flags): a golden file's last bits
# are this machine's when they match the ones recorded with it.
VECTOR_FEATURES = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                   "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile")


def _cpuinfo() -> dict[str, str] | None:
  """The first value of each /proc/cpuinfo field (the first CPU's); None where it cannot be read."""
  try:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return None
  fields: dict[str, str] = {}
  for line in lines:
    key, sep, value = line.partition(":")
    if sep:
      fields.setdefault(key.strip(), value.strip())
  return fields


def cpu_model() -> dict:
  """The host CPU as a golden file names the machine its last bits belong to: vendor, family and
  model (/proc/cpuinfo; XLA:CPU tunes its code to the model, so two CPUs with the same
  `VECTOR_FEATURES` may still round differently) and its vector features."""
  info = _cpuinfo()
  if info is None:
    return {}
  return {"vendor": info.get("vendor_id", ""), "family": info.get("cpu family", ""),
          "model": info.get("model", ""), "features": vector_features()}


def vector_features() -> list[str]:
  """The host CPU's `VECTOR_FEATURES` (empty where /proc/cpuinfo cannot be read)."""
  flags = (_cpuinfo() or {}).get("flags", "").split()
  return sorted(set(flags) & set(VECTOR_FEATURES))


def assert_golden_rows(now: list[dict], golden: list[dict], *, exact: bool, what: str) -> None:
  """Every recorded metric of ``golden``'s steps in ``now``: bit for bit with ``exact``, else to
  float32 rounding, since another CPU may round the last bit of an XLA reduction differently. Means
  such as ``log_z_mean`` (about 0.02) average terms of order one, so their rounding is absolute: a
  few float32 ulps at 1.0 (1.2e-7 each); two CPUs measured 1.3e-7 and 1.8e-7 apart there, and
  3.7e-7 relative on ``grad_norm``. Importance ratios (``omega_*``, ``ratio_*``) are exponentials
  of a difference of two log-probabilities of order ``entropy`` (about 4.9 nats): their rounding
  is relative and sized by the float32 ulp there (4.8e-7), so they get 16 of those; a third CPU
  measured 1.4e-6 apart on ``omega_max``."""
  assert len(now) == len(golden), (what, len(now), len(golden))
  for step, (r_now, r_old) in enumerate(zip(now, golden)):
    ratio_rel = 16 * float(np.spacing(np.float32(r_old["entropy"])))
    for key, value in r_old.items():
      if exact:
        assert r_now[key] == value, (what, step, key, r_now[key], value)
        continue
      rel = ratio_rel if key.startswith(("omega_", "ratio_")) else 1e-6
      assert r_now[key] == pytest.approx(value, rel=rel, abs=1e-6), (what, step, key)
