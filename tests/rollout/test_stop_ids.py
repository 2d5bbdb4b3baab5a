"""Stop ids: the union of the tokenizer's eos, generation_config.json's eos and the chat template's
end of turn (`disa_jax.rollout.stop_ids`). The engines stopping there: `stop_case`, run by
test_jax_sampler.py, test_vllm_engine.py and test_openai_engine_vllm.py."""
import json

import pytest
from transformers import AutoTokenizer

from disa_jax import testing
from disa_jax.rollout.stop_ids import end_of_turn_id, generation_config_eos, stop_token_ids
from tests.rollout import stop_case

EOS = 2  # the tiny tokenizer's eos, <|im_end|>: also its chat template's end of turn
ENDOFTEXT = 3  # <|endoftext|>


@pytest.mark.parametrize("gen_eos,chat,expected", [
    (ENDOFTEXT, False, (EOS, ENDOFTEXT)), ([ENDOFTEXT, 7], True, (EOS, ENDOFTEXT, 7)),
    (None, True, (EOS,)), ([EOS], False, (EOS,))])
def test_union_of_tokenizer_generation_config_and_end_of_turn(tmp_path, gen_eos, chat, expected):
  tok = stop_case.write_tokenizer_dir(str(tmp_path), gen_eos)
  assert stop_token_ids(tok, str(tmp_path), chat_template=chat) == expected


def test_end_of_turn_differs_from_eos(tmp_path):
  """A Qwen-base-like tokenizer: eos <|endoftext|>, chat turns end with <|im_end|>."""
  testing.make_tokenizer().save_pretrained(str(tmp_path))
  tok = AutoTokenizer.from_pretrained(str(tmp_path), eos_token="<|endoftext|>")
  assert tok.eos_token_id == ENDOFTEXT and end_of_turn_id(tok) == EOS
  assert stop_token_ids(tok, str(tmp_path), chat_template=True) == (ENDOFTEXT, EOS)
  assert stop_token_ids(tok, str(tmp_path), chat_template=False) == (ENDOFTEXT,)
  tok.chat_template = None
  with pytest.raises(ValueError, match="no chat template"):
    stop_token_ids(tok, str(tmp_path), chat_template=True)


@pytest.mark.parametrize("value", ["2", [], [1, -1], True, 1.5])
def test_bad_generation_config_eos_is_refused_naming_the_file(tmp_path, value):
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": value}, f)
  with pytest.raises(ValueError, match=r"generation_config\.json: eos_token_id"):
    generation_config_eos(str(tmp_path))
  assert generation_config_eos(str(tmp_path / "absent")) == ()


def test_no_stop_token_at_all_is_refused(tmp_path):
  tok = stop_case.write_tokenizer_dir(str(tmp_path), None)
  tok.eos_token = None
  with pytest.raises(ValueError, match="no stop token"):
    stop_token_ids(tok, str(tmp_path), chat_template=False)

