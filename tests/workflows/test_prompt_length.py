"""The one prompt encoder refuses a prompt longer than max_prompt_len after tokenisation, naming it."""
import pytest

from disa_jax import testing
from disa_jax.data import templates
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.records import PromptRecord


class _SilentTokenizer:

  def __call__(self, text, add_special_tokens=False):
    return {"input_ids": []}


def test_encode_prompt_refuses_prompts_over_max_prompt_len():
  tok = testing.make_tokenizer()  # character-level: one token per character here
  recs = [PromptRecord(f"p{i}", templates.chat_messages(q), "1", "toy")
          for i, q in enumerate(["hi", "a longer question", "ok"])]
  lengths = [len(encode_prompt(tok, r, "chat_template", max_len=10 ** 6)) for r in recs]
  assert lengths[1] > lengths[0] and lengths[1] > lengths[2]
  ids = [encode_prompt(tok, r, "chat_template", max_len=lengths[1]) for r in recs]
  assert [len(x) for x in ids] == lengths  # exactly max_prompt_len tokens is allowed
  with pytest.raises(ValueError, match=rf"^prompt 'p1': {lengths[1]} tokens > "
                                       rf"max_prompt_len={lengths[1] - 1} \(rendering 'chat_template'\)$"):
    encode_prompt(tok, recs[1], "chat_template", max_len=lengths[1] - 1)
  plain = encode_prompt(tok, recs[1], "plain", max_len=10 ** 6)  # no template: the user text
  assert plain == tuple(tok("a longer question", add_special_tokens=False)["input_ids"])
  assert len(plain) < lengths[1]
  silent = _SilentTokenizer()  # a tokenizer that drops the whole text (e.g. unknown characters)
  with pytest.raises(ValueError, match=r"^prompt 'e': tokenises to nothing under rendering 'plain'$"):
    encode_prompt(silent, PromptRecord("e", "??", "1", "toy"), "plain", max_len=4)
  with pytest.raises(ValueError, match=r"rendering must be one of \('chat_template', 'plain'\)"):
    encode_prompt(tok, recs[0], "chat", max_len=4)


def test_run_stage1_stops_at_a_long_prompt_before_any_model_is_loaded(checkpoints, prompt_files,
                                                                       tmp_path, monkeypatch):
  from disa_jax.rollout import EngineConfig  # pylint: disable=g-import-not-at-top
  from disa_jax.workflows import stage1  # pylint: disable=g-import-not-at-top

  def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded for a run that must stop at its prompts")

  monkeypatch.setattr(stage1, "load_reference", no_model)
  cfg = stage1.Stage1Config(
      prompts_path=prompt_files["train"], reference_path=checkpoints["reference"],
      proposal_path=checkpoints["proposal"], output_dir=str(tmp_path / "s1"), max_prompt_len=10,
      engine=EngineConfig(kind="jax", separate_process=False), progress=False)
  with pytest.raises(ValueError, match=r"^prompt '[^']+': \d+ tokens > max_prompt_len=10 "):
    stage1.run_stage1(cfg)
  assert not cfg.dataset_path().exists()
