"""Tiny models, tokenizers and checkpoints for tests (no hub downloads, no torch).

- `make_tokenizer()`: a character-level tokenizer with a few whole-word tokens, special tokens and a
  Qwen-style chat template, built with the `tokenizers` library and wrapped as a transformers fast
  tokenizer (so `AutoTokenizer.from_pretrained` works on a saved directory).
- `tiny_config(family)`, `make_tiny_model(family, seed)`: small random models of each family.
- `save_tiny_checkpoint(path, family, seed)`: an HF-format directory (config.json,
  model.safetensors, tokenizer files) that `disa_jax.models.from_pretrained`, `transformers` and
  vLLM load.
- `require(available, why)`: skips the calling test when a requirement (the vLLM engine, the
  `../shared` data) is missing, but FAILS it under `CI=true`, so CI cannot pass by skipping;
  `in_ci()`, `shared_dir()`. `tests/conftest.py` applies it to every test marked `vllm` or
  `shared_data`.
"""

from __future__ import annotations

import os
import pathlib
import random
import socket
import string
import subprocess
import time
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
from flax import nnx
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from disa_jax.anchor import Anchor, AnchorMeta, AnchorMLP, EmbeddingSpec
from disa_jax.models.config import ModelConfig, RopeScaling
from disa_jax.models.hf_interop import save_pretrained
from disa_jax.models.transformer import Transformer

PAD, BOS, EOS, EOT = "<|pad|>", "<|bos|>", "<|im_end|>", "<|endoftext|>"
IM_START = "<|im_start|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, EOT, IM_START)
WORD_TOKENS = ("the", " the", "answer", " answer", " is", "boxed", "\\boxed{", "user", "assistant",
               "system", "think", "</think>", "<think>", " and", "=", "123", " of")
TINY_VOCAB_SIZE = 128
TINY_HIDDEN = 64  # hidden size of `tiny_config`

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _base_vocab() -> dict[str, int]:
  chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
  vocab: dict[str, int] = {}
  for token in SPECIAL_TOKENS + ("<unk>",) + tuple(chars):
    vocab.setdefault(token, len(vocab))
  return vocab


def make_tokenizer() -> PreTrainedTokenizerFast:
  """Character-level tokenizer plus whole-word tokens, specials and a chat template.

  Ids: `<|pad|>`=0, `<|bos|>`=1, `<|im_end|>`=2 (eos), `<|endoftext|>`=3, `<|im_start|>`=4, then
  `<unk>`, printable ASCII characters and the word tokens; fewer than `TINY_VOCAB_SIZE` in all.
  """
  vocab = _base_vocab()
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens(list(SPECIAL_TOKENS))
  tok.add_tokens(list(WORD_TOKENS))
  if tok.get_vocab_size() > TINY_VOCAB_SIZE:
    raise AssertionError(f"tiny tokenizer has {tok.get_vocab_size()} > {TINY_VOCAB_SIZE} tokens")
  return PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token="<unk>",
      chat_template=CHAT_TEMPLATE, padding_side="left", model_max_length=4096)


def tiny_config(family: str = "qwen3", vocab_size: int | None = None, **overrides: Any
                ) -> ModelConfig:
  """A small config of `family` ('qwen2' | 'qwen3' | 'llama') matching `make_tokenizer`.

  d=64, 2 layers, 4 query heads, 2 kv heads, head_dim 16, mlp 128. Qwen2 has qkv bias, Qwen3
  q/k norm and tied embeddings, Llama llama3 RoPE scaling (short original context so it matters).

  Args:
    family: the model family.
    vocab_size: default `TINY_VOCAB_SIZE` (covers the tiny tokenizer).
    **overrides: any other `ModelConfig` field.
  """
  base: dict[str, Any] = dict(
      family=family, vocab_size=vocab_size or TINY_VOCAB_SIZE, hidden_size=TINY_HIDDEN,
      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
      rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
      bos_token_id=1, eos_token_id=2, pad_token_id=0)
  if family == "qwen2":
    base.update(qkv_bias=True, tie_word_embeddings=False)
  elif family == "qwen3":
    base.update(qk_norm=True, tie_word_embeddings=True, rope_theta=1_000_000.0)
  elif family == "llama":
    base.update(rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False,
                rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
  else:
    raise ValueError(f"tiny_config: unknown family {family!r}")
  base.update(overrides)
  return ModelConfig(**base)


def make_tiny_model(family: str = "qwen3", seed: int = 0, *, dtype: Any = jnp.float32,
                    **overrides: Any) -> Transformer:
  """A randomly initialised tiny `Transformer` (see `tiny_config`; overrides go to the config).

  Norm weights are randomised too (around 1) so that tests exercise them.
  """
  config = tiny_config(family, **overrides)
  model = Transformer(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=dtype)
  rngs = nnx.Rngs(seed + 1)
  for name in model.layers.names:
    var = getattr(model.layers, name)
    if name.endswith("norm") or name.endswith("bias"):
      noise = 0.1 * jnp.asarray(nnx.initializers.normal(1.0)(rngs.params(), var[...].shape))
      var[...] = (var[...] + noise).astype(var[...].dtype)
  model.final_norm[...] = (model.final_norm[...] + 0.1 * nnx.initializers.normal(1.0)(
      rngs.params(), model.final_norm[...].shape)).astype(model.final_norm[...].dtype)
  return model


def save_tiny_checkpoint(path: str, family: str = "qwen3", seed: int = 0, **overrides: Any) -> str:
  """Writes a tiny model (our `save_pretrained`) and the tiny tokenizer into `path`.

  Returns:
    `path`.
  """
  model = make_tiny_model(family, seed, **overrides)
  save_pretrained(model, path)
  make_tokenizer().save_pretrained(path)
  return path


# ------------------------------------------------------------------------------------------------
# Requirements of optional tests: skipped locally, failed in CI.
# ------------------------------------------------------------------------------------------------


def in_ci() -> bool:
  """Whether the environment variable CI is set to true (1 / true / yes, any case)."""
  return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def shared_dir() -> pathlib.Path:
  """The shared data directory: $DISA_SHARED_DIR, default `<repo>/../shared`."""
  default = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared"
  return pathlib.Path(os.environ.get("DISA_SHARED_DIR") or default).resolve()


def require(available: bool, why: str) -> None:
  """Skips the calling test when `available` is false; under `CI=true` fails it instead.

  Args:
    available: whether the requirement is met.
    why: what is missing (e.g. 'vllm is not installed'), shown in the skip or failure.
  """
  if available:
    return
  import pytest  # pylint: disable=g-import-not-at-top  (a test-only dependency)
  if in_ci():
    pytest.fail(f"{why}; CI=true, so a missing requirement fails instead of skipping",
                pytrace=False)
  pytest.skip(why)


def make_command_inputs(root: str | os.PathLike, stage1: Any, stage3: Any,
                        max_position_embeddings: int = 65536) -> None:
  """Creates under ``root`` every input the typed Stage 1 / Stage 3 configs name (relative paths
  are taken from ``root``): tiny checkpoints for the models, empty prompt files, the Stage 1 output
  directory and a Stage 2 anchor whose facts match ``stage3``'s objective and reference. For
  `--dry_run` tests of the paper configs (`disa_jax.workflows.preflight` checks paths, model
  directories, lengths and the anchor).
  """
  root = pathlib.Path(root)
  for model in {stage1.reference_path, stage1.proposal_path, stage3.model.policy_path}:
    save_tiny_checkpoint(str(root / model), max_position_embeddings=max_position_embeddings)
  for data in {stage1.prompts_path, stage3.data.train_path, *stage3.data.validation_paths}:
    (root / data).parent.mkdir(parents=True, exist_ok=True)
    (root / data).touch()
  (root / stage1.output_dir / "stage1").mkdir(parents=True, exist_ok=True)
  obj = stage3.train.objective
  if stage3.data.anchor_path:
    meta = AnchorMeta(embedding=EmbeddingSpec("model_mean_pool", TINY_HIDDEN,
                                              stage3.model.reference, rendering=stage3.data.rendering),
                      beta=obj.beta, reward_transform=obj.reward_transform, label_scale=obj.scale,
                      hidden_sizes=(8,))
    Anchor(AnchorMLP(TINY_HIDDEN, (8,), "relu", rngs=nnx.Rngs(0)), meta).save(
        root / stage3.data.anchor_path)


def free_port() -> int:
  """A TCP port free on localhost now (for a test's JAX coordinator).

  Drawn below the kernel's ephemeral range (``ip_local_port_range``), so no outgoing connection
  or ``bind(0)`` listener (gloo's, gRPC's) of a concurrent test can take it before the
  coordinator binds it; checked bindable.
  """
  low = 32768
  try:
    low = int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
  except (OSError, ValueError, IndexError):
    pass
  rng = random.Random(os.getpid() ^ time.monotonic_ns())
  for _ in range(200):
    port = rng.randrange(10000, max(low, 10001))
    with socket.socket() as s:
      try:
        s.bind(("localhost", port))
      except OSError:
        continue
      return port
  with socket.socket() as s:  # the whole low range taken: fall back to the kernel's choice
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def run_processes(commands: Sequence[tuple[Sequence[str], Mapping[str, str]]], *, cwd: str,
                  timeout: float) -> list[tuple[int, str]]:
  """Starts every ``(argv, env)`` at once and waits for all (a multi-process JAX run).

  Returns:
    (exit code, stdout + stderr) per command; any process still running at the end (a timeout or
    a failure elsewhere) is killed.
  """
  procs = [subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for argv, env in commands]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  return [(p.returncode, out) for p, out in zip(procs, outs)]
