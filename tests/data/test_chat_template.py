"""A tokenizer without a chat template: a named error saying what to do, and the plain-text path.

The tokenizers are the tiny character-level tokenizer of `disa_jax.testing`, with its chat template
removed, saved and reloaded so that it has a name_or_path, as a base model's tokenizer does.
"""
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from disa_jax import data, testing
from disa_jax.data import templates
from disa_jax.eval import runner
from disa_jax.rollout.types import Completion
from disa_jax.data import prompting
from disa_jax.tasks.math import math_prompt

RECORD = data.PromptRecord(
    "toy/0", templates.chat_messages(math_prompt("What is 1+1?"), system="Be brief."),
    "2", "toy", {"ability": "math"})


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
  """A saved-and-reloaded tokenizer without a chat template, and its directory."""
  path = str(tmp_path_factory.mktemp("tok") / "base_model_tokenizer")
  tok = testing.make_tokenizer()
  tok.chat_template = None
  tok.save_pretrained(path)
  tok = AutoTokenizer.from_pretrained(path)
  assert tok.chat_template is None and tok.name_or_path == path
  return tok, path


def _expected(name):
  return re.escape(f"tokenizer {name!r} has no chat template") + r".*" + re.escape(
      "set use_chat_template=False to prompt with the plain user text (PromptRecord.prompt_text())")


def test_render_chat_names_the_tokenizer_and_the_fix(base_tok):
  tok, path = base_tok
  with pytest.raises(data.MissingChatTemplateError, match=_expected(path)):
    templates.render_chat(tok, RECORD.prompt)
  with pytest.raises(ValueError, match=_expected(path)):  # a ValueError for existing handlers
    prompting.encode_prompt(tok, RECORD, "chat_template", max_len=512)  # every stage's encoder
  unnamed = testing.make_tokenizer()
  unnamed.chat_template = None
  with pytest.raises(data.MissingChatTemplateError, match=_expected(type(unnamed).__name__)):
    templates.render_chat(unnamed, RECORD.prompt)
  assert templates.render_chat(tok, "a plain prompt") == "a plain prompt"  # nothing to render


def test_use_chat_template_false_renders_the_user_text(base_tok):
  tok, _ = base_tok
  text = prompting.render_prompt(tok, RECORD, "plain")
  assert text == RECORD.prompt_text() == math_prompt("What is 1+1?")
  assert "Be brief." not in text and "<|im_start|>" not in text
  ids = prompting.encode_prompt(tok, RECORD, "plain", max_len=512)
  assert tok.decode(list(ids)) == text  # the plain text reaches the model unchanged
  with_template = templates.render_chat(testing.make_tokenizer(), RECORD.prompt)
  assert with_template.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # the other path


class _EchoEngine:
  """Answers every prompt with `\\boxed{2}` and records the prompts it was given."""

  def __init__(self, tok):
    self.tok, self.prompts = tok, []

  def generate(self, prompt_token_ids, params):
    self.prompts += [self.tok.decode(list(p)) for p in prompt_token_ids]
    ids = self.tok("\\boxed{2}", add_special_tokens=False)["input_ids"]
    return [[Completion(np.asarray(ids), np.zeros(len(ids)), None, "stop")] * params.n
            for _ in prompt_token_ids]


def test_evaluation_without_a_chat_template(base_tok):
  tok, path = base_tok
  engine = _EchoEngine(tok)
  params = runner.eval_sampling_params(2, 16, tok.eos_token_id)
  with pytest.raises(data.MissingChatTemplateError, match=_expected(path)):
    runner.evaluate_benchmark(engine, tok, [RECORD], params, name="toy")
  assert engine.prompts == []  # refused before any generation
  res = runner.evaluate_benchmark(engine, tok, [RECORD], params, name="toy",
                                  rendering="plain")
  assert engine.prompts == [RECORD.prompt_text()]
  np.testing.assert_array_equal(res.correct, [[True, True]])
