"""The main job's two models, made by the pipeline itself: a weak reference and a stronger proposal.

Both are tiny Qwen3-architecture Flax models trained from random initialisation by supervised
fine-tuning on made-up answers to the sum task, then saved as Hugging Face checkpoints (config.json,
model.safetensors, tokenizer) so that every later stage loads them through the real loading path.

- pi_ref (weak, broad): ``ref_correct_frac`` of its training answers are correct, with a uniform
  over the n + 1 correct splits (a, n - a) at ``skew = 1``; the rest are wrong pairs. Another skew
  makes the target pi~|correct = pi_ref|correct non-uniform (configs/main.py's ``nonuniform_target``:
  1.25, large first summands preferred, against the proposal's small ones). The anchor testbed's
  pi_ref learns to add first (``pretrain_steps``), and its wrong answers are the right sum written
  wrongly (``wrong_answers='format'``), at a share that follows n's last digit.
- p_T (stronger, different preference): pi_ref fine-tuned further on ``proposal_correct_frac``
  correct answers with a skewed preference among them: a is drawn with probability proportional to
  ``proposal_skew ** a`` (small first summands preferred). Starting from pi_ref keeps the warm-up
  cheap and the proposal's support close to the reference's.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from disa_jax import artifacts, codec, paths
from disa_jax.data import packing
from disa_jax.models import ModelConfig, Transformer, save_pretrained
from disa_jax.pipeline import seeds
from disa_jax.sft import SupervisedSchedule, make_sft_step
from disa_jax.tasks.sum import SumTask, make_tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyLMSpec:
  """Architecture of the main job's models (the TRL peer's tiny Qwen3 by default)."""

  hidden_size: int = 128
  intermediate_size: int = 256
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32


WRONG_ANSWERS = ("uniform", "near", "format")
CORRECT_FRAC_OF = ("n", "last_digit")
NEAR_MISS = 3  # largest |b - (n - a)| of a 'near' wrong answer


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmupSpec:
  """Supervised warm-up of one model on made-up answers."""

  correct_frac: float  # share of correct answers in the training data (at n_min, see below)
  skew: float = 1.0  # preference among correct answers: P(a) ~ skew ** a (1 = uniform)
  steps: int = 400
  batch_size: int = 64
  learning_rate: float = 3e-3
  seed: int = 0
  # < 0: every prompt's training answers are correct_frac correct. Else the share falls
  # geometrically from correct_frac at n_min to this at n_max (`correct_frac_at`), so that
  # P_ref(correct | n), and with it log Z(n), differs across prompts (issue 45).
  correct_frac_last: float = codec.field(default=-1.0, omit=-1.0)  # recorded only where set
  # Steps on correct answers only (the task's skill: a + b = n at every n) before the ``steps`` on
  # the mixed data, so that a weak model's errors are a choice it makes, not a skill it lacks:
  # without them, a model whose data has 1% correct answers at large n never learns to add there
  # (issue 45's testbed). 0: none (recorded only where set).
  pretrain_steps: int = codec.field(default=0, omit=0)
  # The wrong answers: 'uniform' pairs (a, b) over the task's number range; 'near' misses
  # (a, n - a + d), 0 < |d| <= NEAR_MISS, a drawn as a correct answer's (an arithmetic slip); or
  # the right sum in the wrong 'format' (without its leading space). With the last two a wrong
  # answer needs the same skill as a right one, and being right is one choice shared by every
  # prompt (issue 45's testbed). Recorded only where not 'uniform'.
  wrong_answers: str = codec.field(default="uniform", omit="uniform")
  # What the geometric fall of the correct share follows: 'n' (t = (n - n_min) / (n_max - n_min))
  # or n's 'last_digit' (t = (n mod 10) / 9), a feature a tiny model reads off one prompt token: it
  # did not learn a share that falls smoothly over n = 0..159 (issue 45's testbed,
  # docs/objectives.md).
  correct_frac_of: str = codec.field(default="n", omit="n")

  def __post_init__(self):
    if not 0.0 <= self.correct_frac <= 1.0:
      raise ValueError(f"WarmupSpec.correct_frac must be in [0, 1], got {self.correct_frac!r}")
    if self.correct_frac_last >= 0 and not (0.0 < self.correct_frac_last <= 1.0
                                            and self.correct_frac > 0):
      raise ValueError(f"WarmupSpec.correct_frac_last must be < 0 (off) or in (0, 1] with "
                       f"correct_frac > 0, got {self.correct_frac_last!r} "
                       f"(correct_frac {self.correct_frac!r})")
    if not self.skew > 0:
      raise ValueError(f"WarmupSpec.skew must be > 0, got {self.skew!r}")
    if self.wrong_answers not in WRONG_ANSWERS:
      raise ValueError(f"WarmupSpec.wrong_answers must be one of {WRONG_ANSWERS}, got "
                       f"{self.wrong_answers!r}")
    if self.correct_frac_of not in CORRECT_FRAC_OF:
      raise ValueError(f"WarmupSpec.correct_frac_of must be one of {CORRECT_FRAC_OF}, got "
                       f"{self.correct_frac_of!r}")
    if self.pretrain_steps < 0:
      raise ValueError(f"WarmupSpec.pretrain_steps must be >= 0, got {self.pretrain_steps!r}")
    if self.steps < 1 or self.batch_size < 1:
      raise ValueError(f"WarmupSpec.steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}")


  def correct_frac_at(self, n: int, n_min: int, n_max: int) -> float:
    """The share of correct training answers for prompt n: ``correct_frac``, or with
    ``correct_frac_last`` the geometric interpolation correct_frac^(1-t) correct_frac_last^t,
    t = (n - n_min) / (n_max - n_min) or, with ``correct_frac_of='last_digit'``, (n mod 10) / 9."""
    if self.correct_frac_last < 0 or (n_max == n_min and self.correct_frac_of == "n"):
      return self.correct_frac
    t = (n % 10) / 9 if self.correct_frac_of == "last_digit" else (n - n_min) / (n_max - n_min)
    return float(self.correct_frac ** (1.0 - t) * self.correct_frac_last ** t)


def model_config(tokenizer, spec: TinyLMSpec) -> ModelConfig:
  return ModelConfig(family="qwen3", vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                     intermediate_size=spec.intermediate_size, num_layers=spec.num_layers,
                     num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                     qk_norm=True, max_position_embeddings=128, tie_word_embeddings=False,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)


def _answer_text(rng: np.random.Generator, task: SumTask, n: int, spec: WarmupSpec,
                 correct_only: bool = False) -> str:
  """One made-up answer to prompt n: correct with the spec's share at n (always with
  ``correct_only``), else wrong as ``spec.wrong_answers`` says."""
  correct = correct_only or rng.random() < spec.correct_frac_at(n, task.n_min, task.n_max)
  if correct or spec.wrong_answers != "uniform":
    w = spec.skew ** np.arange(n + 1, dtype=np.float64)
    a = int(rng.choice(n + 1, p=w / w.sum()))
    if correct:
      return task.answer_text(a, n - a)
    if spec.wrong_answers == "format":  # the right sum without the leading space it must have
      return task.answer_text(a, n - a).lstrip(" ")
    slips = [d for d in range(-NEAR_MISS, NEAR_MISS + 1) if d and n - a + d >= 0]
    return task.answer_text(a, n - a + int(rng.choice(slips)))
  while True:  # a wrong pair in the same number range
    a, b = int(rng.integers(0, task.n_max + 1)), int(rng.integers(0, task.n_max + 1))
    if a + b != n:
      return task.answer_text(a, b)


WARMUP_ROW_LEN = 64


def _warmup_layout(tok, task: SumTask, prompt_lens: list[int], batch_size: int
                   ) -> packing.PackingLayout:
  """Packed rows of `WARMUP_ROW_LEN` tokens, enough of them that any batch fits in one micro-batch:
  with sequences of at most ``longest`` tokens, first-fit-decreasing puts at least
  k = row_len // longest sequences in every row it fills (a row with fewer has room for one more)."""
  answer = max(len(tok.encode(task.answer_text(a, b), add_special_tokens=False))
               for a in range(task.n_max + 1) for b in range(task.n_max + 1)) + 1  # + EOS
  longest = max(prompt_lens) + answer
  per_row = WARMUP_ROW_LEN // longest
  if per_row < 1:
    raise ValueError(f"a warm-up sequence of {longest} tokens exceeds WARMUP_ROW_LEN={WARMUP_ROW_LEN}")
  return packing.micro_batch_layout(-(-batch_size // per_row), row_len=WARMUP_ROW_LEN,
                                    seqs_per_row=per_row * 2)


def train_sum_model(task: SumTask, arch: TinyLMSpec, spec: WarmupSpec, *, init_from: Transformer | None = None,
                    progress: bool = True, desc: str = "warm-up") -> tuple[Transformer, dict]:
  """Supervised warm-up from random init (or in place from ``init_from``): ``spec.pretrain_steps``
  steps on correct answers only, then ``spec.steps`` on the mixed data, under one schedule.

  Returns:
    (model, summary with the loss curve and the time).
  """
  tok = make_tokenizer()
  model = init_from if init_from is not None else Transformer(model_config(tok, arch), rngs=nnx.Rngs(spec.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  total = spec.pretrain_steps + spec.steps
  tx, step = make_sft_step(SupervisedSchedule(learning_rate=spec.learning_rate,
                                              warmup_steps=min(20, total), total_steps=total,
                                              schedule="constant"),
                           graphdef, loss="batch_mean")
  opt_state = tx.init(params)
  rng = np.random.default_rng(seeds.job_seed(spec.seed, "warmup_data"))
  prompts = {n: tok.encode(task.prompt(n), add_special_tokens=False) for n in task.ns}
  layout = _warmup_layout(tok, task, [len(p) for p in prompts.values()], spec.batch_size)
  losses, t0 = [], time.time()
  for i in tqdm(range(total), desc=desc, disable=not progress):
    ns = rng.integers(task.n_min, task.n_max + 1, size=spec.batch_size)
    pretraining = i < spec.pretrain_steps
    texts = [_answer_text(rng, task, int(n), spec, correct_only=pretraining) for n in ns]
    resp = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    (b,) = packing.pack([prompts[int(n)] for n in ns], resp, layout, pad_id=tok.pad_token_id)
    rows = {k: jnp.asarray(getattr(b.rows, k)) for k in ("input_ids", "segment_ids", "positions",
                                                          "response_mask")}
    params, opt_state, loss = step(params, opt_state, rest, [rows])
    losses.append(float(loss))
  nnx.update(model, params)
  return model, {"steps": total, "seconds": time.time() - t0, "loss_first": losses[0],
                 "loss_last20": float(np.mean(losses[-20:])), "losses": losses}


def save_model(model: Transformer, path: str | Path) -> str:
  """Writes the HF checkpoint and the task tokenizer to ``path``."""
  path = Path(path)
  save_pretrained(model, str(path))
  make_tokenizer().save_pretrained(str(path))
  return str(path)


MARKER = "warmup.json"  # a warmed-up model's record, written last: marks a whole model


def save_warmed_model(model: Transformer, path: str | Path, tokenizer: Any,
                      record: dict[str, Any]) -> None:
  """`save_model`, then ``tokenizer`` and ``record`` (`MARKER`), whole or not at all: written into
  ``<path>.partial`` and renamed into place, so a process killed mid-save leaves no model that a
  rerun would take for a saved one (whatever is at ``path`` without a marker is replaced)."""
  partial = Path(f"{path}.partial")
  paths.remove(partial)  # (left by a process killed while saving)
  save_model(model, partial)
  tokenizer.save_pretrained(str(partial))
  artifacts.write_json(partial / MARKER, record)
  paths.remove(path)
  partial.rename(path)
