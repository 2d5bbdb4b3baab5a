"""`load_tokenizer`: the plain fast tokenizer without AutoTokenizer's import, the same tokenizer."""
import json
import subprocess
import sys

from transformers import AutoTokenizer

from disa_jax import testing
from disa_jax.data.tokenizer import load_tokenizer, tokenizer_class_name

MESSAGES = [{"role": "user", "content": "what is 2 + 3? the answer is boxed"}]


def _same(a, b):
  assert type(a) is type(b)
  for text in ("hello the answer is 7", "\\boxed{123} and </think>", ""):
    assert a(text)["input_ids"] == b(text)["input_ids"]
  assert a.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == \
      b.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
  for attr in ("pad_token_id", "eos_token_id", "bos_token_id", "padding_side", "all_special_ids"):
    assert getattr(a, attr) == getattr(b, attr), attr
  assert len(a) == len(b)


def test_a_saved_tiny_tokenizer_loads_as_autotokenizer_loads_it(tmp_path):
  testing.make_tokenizer().save_pretrained(tmp_path)
  assert tokenizer_class_name(tmp_path) in ("TokenizersBackend", "PreTrainedTokenizerFast")
  _same(load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path))


def test_the_plain_path_does_not_import_autotokenizer_or_torch(tmp_path):
  testing.make_tokenizer().save_pretrained(tmp_path)
  code = ("import sys; from disa_jax.data.tokenizer import load_tokenizer; "
          f"load_tokenizer({str(tmp_path)!r}); "
          "print(sorted(m for m in ('torch', 'transformers.models.auto.tokenization_auto') "
          "if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", out.stdout


def test_a_model_specific_class_goes_through_autotokenizer(tmp_path):
  testing.make_tokenizer().save_pretrained(tmp_path)
  config = json.loads((tmp_path / "tokenizer_config.json").read_text())
  config["tokenizer_class"] = "Qwen2Tokenizer"
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  tok = load_tokenizer(tmp_path)
  assert type(tok).__name__.startswith("Qwen2Tokenizer"), type(tok)
  assert type(tok) is type(AutoTokenizer.from_pretrained(tmp_path))


def test_threads_of_a_fresh_process_load_their_tokenizers_at_once(tmp_path):
  """transformers' lazy names are not thread-safe: five threads importing PreTrainedTokenizerFast
  at once in a fresh process fail in all but one (as the seeds of a seed batch did)."""
  testing.make_tokenizer().save_pretrained(tmp_path)
  code = ("import threading; from disa_jax.data.tokenizer import load_tokenizer\n"
          "errors = []\n"
          "def load():\n"
          "  try:\n"
          f"    load_tokenizer({str(tmp_path)!r})\n"
          "  except Exception as e:\n"
          "    errors.append(repr(e))\n"
          "threads = [threading.Thread(target=load) for _ in range(5)]\n"
          "[t.start() for t in threads]; [t.join() for t in threads]\n"
          "print(errors)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "[]", out.stdout
