"""The LoRA-SFT distillation baseline (paper §4.2 / App. D.4) on the Stage 1 trajectories.

Pipeline: keep the Stage 1 samples whose verifier reward is 1 (`filter_reward_one`), pair each with
its prompt, LoRA fine-tune pi_ref on the response tokens (AdamW, cosine schedule, global batch 128,
3 epochs, bf16 compute where the accelerator has it), fold the adapters into the base weights and
export the merged model in Hugging Face format (`save_pretrained`), so that it is evaluated exactly
like the RL policies.

`run_lora_sft` is resumable: it returns the stored summary when the merged export exists, and
otherwise restarts from the newest adapter checkpoint (adapters + optimizer state, orbax) under
``<out_path>.ckpt``. Batches are fixed by (seed, epoch): a restarted run sees the same data order.
Each batch is packed into micro-batches of ``micro_batch_rows`` rows of ``row_len`` tokens
(`disa_jax.data.packing`; one sequence per padded row with ``packing=False``), whose number varies
with the lengths while their shape does not.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax import config as config_lib
from disa_jax import codec, models, parallel, preemption
from disa_jax.checkpoint import CheckpointManager
from disa_jax.data import packing as packing_lib
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.estimators.dataset import Stage1Data, load_stage1
from disa_jax.parallel import distributed
from disa_jax.sft import lora
from disa_jax.sft.supervised import SupervisedSchedule, make_sft_step

SUMMARY_FILE = "sft_summary.json"
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRASFTConfig:
  """Settings of the LoRA-SFT baseline (defaults: App. D.4, Table 7).

  Attributes:
    rank, alpha, targets: the adapters (`lora.LoRAConfig`).
    learning_rate: AdamW peak learning rate.
    warmup_steps: linear warm-up before the cosine decay (not stated in the paper).
    weight_decay: AdamW weight decay on the adapters.
    grad_clip: global-norm clip (0 = off).
    batch_size: sequences per optimizer update (global batch).
    micro_batch_rows: rows per forward/backward; gradients are accumulated over the batch's
      micro-batches (token-weighted, i.e. equal to the full batch); on a mesh rounded up to a
      multiple of its data x fsdp batch shards.
    epochs: passes over the kept samples.
    max_seq_len: prompt + response tokens; longer responses are truncated (counted in the summary).
    keep_reward: the reward a sample must have to be kept (1.0 = verified correct).
    compute_dtype: 'auto' (bfloat16 on GPU/TPU, float32 on CPU), 'bfloat16' or 'float32'.
    packing: several sequences per row (default); False: one sequence per row, padded to the
      batch's longest rounded up to ``pad_to`` (kept for comparison).
    row_len: tokens per packed row; 0 = the longest kept example rounded up to ``pad_to`` (fixed
      for the run: one compiled shape).
    seqs_per_row: most sequences in one packed row.
    pad_to: the length bucket of ``row_len=0`` and, without packing, of each micro-batch.
    seed: data order and adapter initialisation.
    checkpoint_every: optimizer updates between adapter checkpoints (0 = only at the end).
    remat: recompute each layer's activations in the backward pass (long sequences).
    remat_policy: what a recomputed layer keeps (`disa_jax.config.REMAT_POLICIES`).
    attention_chunk: attention query block ('xla' / 'dense' attention; 0 = no chunking: the
      implementation's own query blocks; c > 0 = blocks of c queries whose probabilities the
      backward pass recomputes; `disa_jax.models.Transformer`).
    attention_impl: the attention over packed rows (`disa_jax.config.ATTENTION_IMPLS`); the model
      is told that a row holds at most ``seqs_per_row`` sequences of at most ``max_seq_len``
      tokens each (`max_segment_len`: the 'xla' band).
  """
  rank: int = 64
  alpha: float = 128.0
  targets: tuple[str, ...] = lora.ALL_TARGETS
  learning_rate: float = 2e-5
  warmup_steps: int = 0
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  batch_size: int = 128
  micro_batch_rows: int = 8
  epochs: int = 3
  max_seq_len: int = 18432
  keep_reward: float = 1.0
  compute_dtype: str = "auto"
  packing: bool = True
  row_len: int = 0
  seqs_per_row: int = 16
  pad_to: int = 64
  seed: int = 0
  checkpoint_every: int = 100
  remat: bool = False
  remat_policy: str = "full"
  attention_chunk: int = 0
  attention_impl: str = "auto"

  def __post_init__(self):
    config_lib.check_attention_chunk(self.attention_chunk, "LoRASFTConfig.attention_chunk")
    config_lib.check_attention_impl(self.attention_impl, "LoRASFTConfig.attention_impl")
    config_lib.check_remat_policy(self.remat_policy, "LoRASFTConfig.remat_policy")
    lora.LoRAConfig(self.rank, self.alpha, tuple(self.targets))  # validates the adapter fields
    for field in ("batch_size", "micro_batch_rows", "epochs", "max_seq_len", "pad_to",
                  "seqs_per_row"):
      if getattr(self, field) < 1:
        raise ValueError(f"LoRASFTConfig.{field} must be >= 1, got {getattr(self, field)!r}")
    if self.row_len < 0 or 0 < self.row_len < self.max_seq_len:
      raise ValueError(f"LoRASFTConfig.row_len must be 0 or >= max_seq_len={self.max_seq_len} "
                       f"(a row holds the longest sequence), got {self.row_len!r}")
    if self.compute_dtype not in ("auto", "bfloat16", "float32"):
      raise ValueError(f"LoRASFTConfig.compute_dtype must be auto|bfloat16|float32, got "
                       f"{self.compute_dtype!r}")
    if not self.learning_rate > 0:
      raise ValueError(f"LoRASFTConfig.learning_rate must be > 0, got {self.learning_rate!r}")
    if self.weight_decay < 0 or self.warmup_steps < 0:
      raise ValueError(f"LoRASFTConfig.weight_decay and warmup_steps must be >= 0, got "
                       f"{self.weight_decay!r}, {self.warmup_steps!r}")
    if self.checkpoint_every < 0:
      raise ValueError(f"LoRASFTConfig.checkpoint_every must be >= 0, got {self.checkpoint_every!r}")

  @property
  def lora(self) -> lora.LoRAConfig:
    return lora.LoRAConfig(self.rank, self.alpha, tuple(self.targets))

  def sft(self, total_steps: int) -> SupervisedSchedule:
    return SupervisedSchedule(learning_rate=self.learning_rate, warmup_steps=self.warmup_steps,
                     total_steps=total_steps, schedule="cosine", weight_decay=self.weight_decay,
                     grad_clip=self.grad_clip)

  def layout(self, longest: int, shards: int = 1) -> packing_lib.PackingLayout:
    """The micro-batch layout for examples of at most ``longest`` tokens (without packing: each
    micro-batch padded to its own longest); ``micro_batch_rows`` rounded up to a multiple of the
    mesh's ``shards`` (data x fsdp)."""
    row_len = (self.row_len or packing_lib.round_up(longest, self.pad_to)) if self.packing else 0
    return packing_lib.micro_batch_layout(self.micro_batch_rows, packing=self.packing,
                                          row_len=row_len, shards=shards,
                                          seqs_per_row=self.seqs_per_row, pad_to=self.pad_to,
                                          max_segment_len=self.max_segment_len)

  @property
  def max_segment_len(self) -> int:
    """The longest segment of a packed row: ``max_seq_len`` (examples are cut to it; 0 without
    packing). The model's ``max_segment_len`` (the 'xla' band) and `layout`'s (refused on the host
    while packing) are this one bound."""
    return self.max_seq_len if self.packing else 0

  def dtype(self) -> Any:
    if self.compute_dtype == "auto":
      return jnp.bfloat16 if jax.default_backend() in ("gpu", "tpu") else jnp.float32
    return jnp.dtype(self.compute_dtype)



@dataclasses.dataclass(frozen=True)
class SFTExample:
  """One kept trajectory: prompt text, its response tokens (and where it came from)."""
  prompt_id: str
  prompt: str
  response_ids: tuple[int, ...]
  sample_index: int


def filter_reward_one(data: Stage1Data, keep_reward: float = 1.0) -> list[SFTExample]:
  """The Stage 1 samples with reward exactly ``keep_reward``, in (prompt, sample) order.

  Args:
    data: a loaded Stage 1 dataset (``data.samples[p][i]``, `Stage1Sample`).
    keep_reward: the reward to keep (1.0: verified correct).

  Returns:
    One `SFTExample` per kept sample.
  """
  out = []
  for p, samples in enumerate(data.samples):
    for i, sample in enumerate(samples):
      if sample.reward == keep_reward:
        if not sample.token_ids:
          raise ValueError(f"Stage 1 prompt {data.prompt_ids[p]!r} sample {i} has reward "
                           f"{keep_reward} but no response tokens")
        out.append(SFTExample(data.prompt_ids[p], data.prompts[p], sample.token_ids, i))
  return out


def _default_encoder(reference_path: str) -> Callable[[str], Sequence[int]]:
  tok = load_tokenizer(reference_path)
  return lambda text: tok.encode(text, add_special_tokens=False)


def _pad_id(reference_path: str) -> int:
  cfg = models.load_config(reference_path)
  return int(cfg.pad_token_id if cfg.pad_token_id is not None else 0)


def _export_complete(out_path: str) -> bool:
  return (os.path.exists(os.path.join(out_path, SUMMARY_FILE))
          and os.path.exists(os.path.join(out_path, "config.json")))


def _copy_tokenizer_files(src: str, dst: str) -> None:
  for name in os.listdir(src):
    full = os.path.join(src, name)
    if os.path.isfile(full) and name not in _MODEL_FILES and not name.startswith("model-"):
      shutil.copy2(full, os.path.join(dst, name))


@dataclasses.dataclass(frozen=True)
class _EncodedExamples:
  """The kept examples as token ids (E of them), responses truncated to fit ``max_seq_len``.

  Attributes:
    prompts: per example, the prompt's token ids.
    responses: per example, the response's token ids (possibly truncated).
    num_truncated: responses that were truncated.
    num_prompts: distinct prompts among the examples.
  """
  prompts: list[list[int]]
  responses: list[list[int]]
  num_truncated: int
  num_prompts: int


def _encode_examples(examples: Sequence[SFTExample], encode: Callable[[str], Sequence[int]],
                     max_seq_len: int) -> _EncodedExamples:
  """Encodes each example's prompt (once per prompt) and truncates its response to fit.

  Args:
    examples: the kept Stage 1 samples (`filter_reward_one`).
    encode: prompt text -> token ids.
    max_seq_len: the longest prompt + response, in tokens.

  Returns:
    The `_EncodedExamples`, in the order of ``examples``.

  Raises:
    ValueError: a prompt alone has ``max_seq_len`` tokens or more.
  """
  prompt_cache: dict[str, list[int]] = {}
  prompts, responses, truncated = [], [], 0
  for ex in examples:
    if ex.prompt_id not in prompt_cache:
      prompt_cache[ex.prompt_id] = [int(t) for t in encode(ex.prompt)]
    p = prompt_cache[ex.prompt_id]
    if len(p) >= max_seq_len:
      raise ValueError(f"prompt {ex.prompt_id!r} has {len(p)} tokens >= max_seq_len="
                       f"{max_seq_len}")
    r = list(ex.response_ids)
    if len(p) + len(r) > max_seq_len:
      r = r[:max_seq_len - len(p)]
      truncated += 1
    prompts.append(p)
    responses.append(r)
  return _EncodedExamples(prompts, responses, truncated, len(prompt_cache))


def _lora_model(reference_path: str, config: LoRASFTConfig, dtype: Any, mesh: Mesh | None
                ) -> tuple[nnx.GraphDef, nnx.State, nnx.State, NamedSharding | None]:
  """Loads pi_ref, adds the adapters, shards it on ``mesh`` and splits off the adapter parameters.

  Args:
    reference_path: pi_ref's HF checkpoint directory.
    config: the adapter settings and seed.
    dtype: the compute dtype.
    mesh: optional device mesh (`TRAIN_RULES` sharding).

  Returns:
    (graphdef, adapter parameters, the other state, the ``[R, L]`` micro-batch sharding or None
    without a mesh).

  """
  model = models.from_pretrained(reference_path, dtype=dtype, mesh=mesh, remat=config.remat,
                                 remat_policy=config.remat_policy,
                                 attention_chunk=config.attention_chunk,
                                 attention_impl=config.attention_impl,
                                 max_segments=config.seqs_per_row if config.packing else 1,
                                 max_segment_len=config.max_segment_len)
  lora.apply_lora(model, config.lora, seed=config.seed)
  batch_sharding = None
  if mesh is not None:
    parallel.shard_model(model, mesh, parallel.TRAIN_RULES)  # places the adapters too
    batch_sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
  graphdef, lora_params, rest = nnx.split(model, lora.LoRAParam, ...)
  return graphdef, lora_params, rest, batch_sharding


def _adapter_state(lora_params: nnx.State, opt_state: Any) -> dict[str, Any]:
  """The checkpointed training state: adapters (a pure dict) and optimizer state."""
  return {"lora": nnx.to_pure_dict(lora_params), "opt_state": opt_state}


def _restore_adapters(ckpt: CheckpointManager, lora_params: nnx.State, opt_state: Any,
                      config: LoRASFTConfig, num_examples: int, total_steps: int, out_path: str,
                      say: Callable[[str], None]) -> tuple[Any, int, list[float]]:
  """Restores the newest adapter checkpoint, if any, into ``lora_params`` (in place).

  Args:
    ckpt: the adapter checkpoint manager (``<out_path>.ckpt``).
    lora_params: the freshly initialised adapters; overwritten by the restored ones.
    opt_state: the freshly initialised optimizer state (the restore template).
    config: this run's settings (must equal the checkpoint's).
    num_examples: this run's number of kept examples (must equal the checkpoint's).
    total_steps: optimizer updates of the whole run (for the message).
    out_path: the export directory (for the message).
    say: progress messages.

  Returns:
    (optimizer state, first step to run, losses of the steps already run).

  Raises:
    ValueError: the checkpoint was written with another config or number of examples.
  """
  latest = ckpt.latest_step()
  if latest is None:
    return opt_state, 0, []
  _, restored, meta = ckpt.restore(_adapter_state(lora_params, opt_state), latest)
  if meta["config"] != codec.encode(config) or meta["num_examples"] != num_examples:
    raise ValueError(f"cannot resume {out_path}.ckpt: it was written with config "
                     f"{meta['config']} on {meta['num_examples']} examples, this run has "
                     f"{codec.encode(config)} on {num_examples}")
  nnx.replace_by_pure_dict(lora_params, restored["lora"])
  say(f"lora-sft: resumed at step {latest}/{total_steps}")
  return restored["opt_state"], latest, list(meta["losses"])


def _sft_batch(step: int, steps_per_epoch: int, enc: _EncodedExamples, config: LoRASFTConfig,
               layout: packing_lib.PackingLayout, pad_id: int
               ) -> list[packing_lib.PackedBatch]:
  """The micro-batches of one optimizer update, fixed by (seed, epoch) so that a resumed run sees
  the same.

  Args:
    step: the 0-based optimizer update.
    steps_per_epoch: updates per pass over the examples.
    enc: the encoded examples.
    config: batch size and seed.
    layout: the micro-batch layout (`LoRASFTConfig.layout`).
    pad_id: the padding token id.

  Returns:
    The `disa_jax.data.packing.PackedBatch` micro-batches (``[R, L]`` rows each); every example
    of the batch is in exactly one slot.
  """
  n = len(enc.prompts)
  epoch, j = divmod(step, steps_per_epoch)
  order = np.random.default_rng([config.seed, epoch]).permutation(n)
  idx = order[j * config.batch_size:(j + 1) * config.batch_size]
  if len(idx) < config.batch_size:  # last batch of the epoch: wrap around to fill it
    idx = np.concatenate([idx, order[:config.batch_size - len(idx)]])
  return packing_lib.pack([enc.prompts[i] for i in idx], [enc.responses[i] for i in idx], layout,
                          pad_id=pad_id)


def _place(batches: Sequence[packing_lib.PackedBatch], batch_sharding: NamedSharding | None
           ) -> list[Any]:
  """The micro-batches' rows as step inputs: host arrays, or global arrays over ``batch_sharding``
  (each process feeds its own rows)."""
  if batch_sharding is None:
    return [b.rows for b in batches]
  return [distributed.shard_global_batch(b.rows, batch_sharding) for b in batches]


def _train_adapters(graphdef: nnx.GraphDef, lora_params: nnx.State, rest: nnx.State,
                    enc: _EncodedExamples, config: LoRASFTConfig, pad_id: int,
                    batch_sharding: NamedSharding | None, steps_per_epoch: int, out_path: str,
                    say: Callable[[str], None]
                    ) -> tuple[nnx.State, list[float], dict[str, float]]:
  """Trains the adapters for ``config.epochs`` epochs, resuming from and writing adapter checkpoints.

  Args:
    graphdef, lora_params, rest: the split adapted model (`_lora_model`).
    enc: the encoded examples.
    config: settings.
    pad_id: the padding token id.
    batch_sharding: the ``[R, L]`` micro-batch sharding, or None.
    steps_per_epoch: updates per epoch.
    out_path: the export directory (checkpoints go to ``<out_path>.ckpt``).
    say: progress messages.

  Returns:
    (the trained adapter parameters, the loss of every update of the run, packing statistics of
    the updates run here: ``packing_efficiency`` (real / computed tokens) and
    ``micro_batches_per_step``, and ``preempted_at``: the step a SIGTERM / SIGUSR1 stopped the
    run at, with a checkpoint, or None; `disa_jax.preemption`).
  """
  n = len(enc.prompts)
  total_steps = steps_per_epoch * config.epochs
  shards = 1 if batch_sharding is None else parallel.batch_shards(batch_sharding.mesh)
  layout = config.layout(max(len(p) + len(r) for p, r in zip(enc.prompts, enc.responses)), shards)
  tx, step_fn = make_sft_step(config.sft(total_steps), graphdef)
  opt_state = tx.init(lora_params)
  ckpt = CheckpointManager(out_path.rstrip("/") + ".ckpt", max_to_keep=1, async_save=False)
  opt_state, start, losses = _restore_adapters(ckpt, lora_params, opt_state, config, n, total_steps,
                                               out_path, say)
  real = computed = micro = 0
  preempted_at, saved = None, start
  for step in range(start, total_steps):
    if preemption.agreed(distributed.any_process):  # SIGTERM / SIGUSR1: save and stop
      if saved != step:
        ckpt.save(step, _adapter_state(lora_params, opt_state),
                  {"config": codec.encode(config), "num_examples": n, "losses": losses}, force=True)
      preempted_at = step
      say(f"lora-sft: preempted ({preemption.requested() or 'another process'}); checkpoint "
          f"{step} saved, rerun to resume")
      break
    batches = _sft_batch(step, steps_per_epoch, enc, config, layout, pad_id)
    real += sum(b.num_real_tokens for b in batches)
    computed += sum(b.num_computed_tokens for b in batches)
    micro += len(batches)
    lora_params, opt_state, loss = step_fn(lora_params, opt_state, rest,
                                           _place(batches, batch_sharding))
    losses.append(float(loss))
    done = step + 1
    if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == total_steps:
      ckpt.save(done, _adapter_state(lora_params, opt_state), {"config": codec.encode(config), "num_examples": n,
                                                               "losses": losses}, force=True)
      saved = done
    say(f"lora-sft: step {done}/{total_steps} loss {losses[-1]:.4f}")
  ckpt.close()
  run = max(total_steps - start, 1)
  stats = {"packing_efficiency": real / max(computed, 1), "micro_batches_per_step": micro / run,
           "preempted_at": preempted_at}
  return lora_params, losses, stats


def _merge_adapters(graphdef: nnx.GraphDef, lora_params: nnx.State, rest: nnx.State) -> tuple[Any, int]:
  """Folds the adapters into the base weights, on the host, for the export.

  Args:
    graphdef, lora_params, rest: the split adapted model.

  Returns:
    (the merged model without adapters or sharding, the number of adapter scalars).
  """
  if jax.process_count() > 1:  # a full host copy on every process for the export
    lora_params, rest = jax.tree.map(jnp.asarray,
                                     distributed.replicate_to_hosts((lora_params, rest)))
  model = nnx.merge(graphdef, lora_params, rest)
  model.sharding = None
  merged = lora.merge_lora(model)
  return merged, lora.lora_param_count(model)


def _write_export(merged: Any, summary: dict[str, Any], reference_path: str, out_path: str) -> None:
  """Process 0 writes the merged model, pi_ref's tokenizer files and, last, the summary."""
  if jax.process_index() == 0:
    models.save_pretrained(merged, out_path)
    _copy_tokenizer_files(reference_path, out_path)
    with open(os.path.join(out_path, SUMMARY_FILE), "w") as f:  # written last: marks completion
      json.dump(summary, f, indent=2)


def run_lora_sft(reference_path: str, stage1_path: str, out_path: str,
                 config: LoRASFTConfig = LoRASFTConfig(), *,
                 encode_prompt: Callable[[str], Sequence[int]] | None = None,
                 mesh: Mesh | None = None,
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
  """Runs the LoRA-SFT baseline and writes the merged HF checkpoint to ``out_path``.

  Args:
    reference_path: pi_ref's HF checkpoint directory.
    stage1_path: the Stage 1 dataset (jsonl or parquet directory).
    out_path: directory of the merged export (config.json, model.safetensors, tokenizer files
      copied from ``reference_path``, ``sft_summary.json``).
    config: settings.
    encode_prompt: prompt text -> token ids, as the RL stages encode prompts (default: the
      reference directory's tokenizer, ``add_special_tokens=False``).
    mesh: optional device mesh (`disa_jax.parallel.make_mesh`, possibly spanning several
      processes after `disa_jax.parallel.distributed.initialize`): weights and adapters are
      sharded with `TRAIN_RULES`, each micro-batch over ('data', 'fsdp'), and every process feeds
      only its own rows. Every process must call this function; only process 0 writes the export.
    log: progress messages (e.g. ``print``); None = silent.

  Returns:
    The summary dict (also in ``sft_summary.json``): counts of prompts / samples / kept samples,
    truncations, steps, first and last loss, adapter size, timings, ``skipped`` (True when the
    export already existed). Under `disa_jax.preemption.watch` (the SFT command), a SIGTERM /
    SIGUSR1 saves the adapters at the next update boundary and returns ``{"preempted": step,
    ...}`` without an export; a rerun resumes.
  """
  say = log or (lambda _: None)
  if _export_complete(out_path):
    with open(os.path.join(out_path, SUMMARY_FILE)) as f:
      summary = json.load(f)
    say(f"lora-sft: export exists at {out_path}; skipped")
    return dict(summary, skipped=True)
  t0 = time.perf_counter()
  data = load_stage1(stage1_path)
  examples = filter_reward_one(data, config.keep_reward)
  if not examples:
    raise ValueError(f"{stage1_path}: no Stage 1 sample has reward {config.keep_reward}; "
                     "nothing to fine-tune on")
  enc = _encode_examples(examples, encode_prompt or _default_encoder(reference_path), config.max_seq_len)
  n = len(examples)
  steps_per_epoch = math.ceil(n / config.batch_size)
  dtype = config.dtype()
  pad_id = _pad_id(reference_path)
  graphdef, lora_params, rest, batch_sharding = _lora_model(reference_path, config, dtype, mesh)
  lora_params, losses, packing_stats = _train_adapters(graphdef, lora_params, rest, enc, config,
                                                       pad_id, batch_sharding, steps_per_epoch,
                                                       out_path, say)
  if packing_stats["preempted_at"] is not None:  # no export: a rerun resumes from the checkpoint
    return {"preempted": packing_stats["preempted_at"], "out_path": out_path, "skipped": False}
  merged, num_lora = _merge_adapters(graphdef, lora_params, rest)
  summary = {
      "num_prompts": len(data.prompt_ids), "num_samples": int(data.mask.sum()),
      "num_kept": n, "num_prompts_with_kept": enc.num_prompts, "num_truncated": enc.num_truncated,
      "steps": steps_per_epoch * config.epochs, "steps_per_epoch": steps_per_epoch, "epochs": config.epochs,
      "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
      "lora_params": num_lora, "compute_dtype": jnp.dtype(dtype).name, **packing_stats,
      "config": codec.encode(config), "out_path": out_path, "seconds": time.perf_counter() - t0,
      "skipped": False,
  }
  _write_export(merged, summary, reference_path, out_path)
  say(f"lora-sft: merged export written to {out_path}")
  return summary
