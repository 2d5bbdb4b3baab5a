"""Stage 1's prompt encoding refuses a prompt longer than max_prompt_len after tokenisation."""
import pytest

from disa_jax import testing
from disa_jax.data import templates
from disa_jax.data.records import PromptRecord
from disa_jax.workflows import prompting


def test_encode_prompts_refuses_prompts_over_max_prompt_len():
  tok = testing.make_tokenizer()  # character-level: one token per character here
  recs = [PromptRecord(f"p{i}", templates.chat_messages(q), "1", "toy")
          for i, q in enumerate(["hi", "a longer question", "ok"])]
  texts = [prompting.render_prompt(tok, r, True) for r in recs]
  lengths = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
  assert lengths[1] > lengths[0] and lengths[1] > lengths[2]
  ids = prompting.encode_prompts(tok, texts, max_len=lengths[1], where="reference prompts")
  assert [len(x) for x in ids] == lengths  # exactly max_prompt_len tokens is allowed
  with pytest.raises(ValueError, match=rf"^reference prompts\[1\]: prompt has {lengths[1]} tokens "
                                       rf"> max_prompt_len={lengths[1] - 1}$"):
    prompting.encode_prompts(tok, texts, max_len=lengths[1] - 1, where="reference prompts")
  plain = [prompting.render_prompt(tok, r, False) for r in recs]  # no template: shorter
  assert prompting.encode_prompts(tok, plain, max_len=len(plain[1]), where="p")[1] == tuple(
      tok(plain[1], add_special_tokens=False)["input_ids"])
  with pytest.raises(ValueError, match=r"^p\[0\]: the prompt tokenises to nothing$"):
    prompting.encode_prompts(tok, [""], max_len=4, where="p")


def test_run_stage1_stops_at_a_long_prompt_before_any_model_is_loaded(checkpoints, prompt_files,
                                                                       tmp_path, monkeypatch):
  from disa_jax.workflows import stage1  # pylint: disable=g-import-not-at-top

  def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded for a run that must stop at its prompts")

  monkeypatch.setattr(stage1, "load_reference", no_model)
  cfg = stage1.Stage1Config(
      prompts_path=prompt_files["train"], reference_path=checkpoints["reference"],
      proposal_path=checkpoints["proposal"], output_dir=str(tmp_path / "s1"), max_prompt_len=10,
      engine=stage1.EngineConfig(kind="jax", separate_process=False), progress=False)
  with pytest.raises(ValueError, match=r"^reference prompts\[0\]: prompt has \d+ tokens > "
                                       r"max_prompt_len=10$"):
    stage1.run_stage1(cfg)
  assert not cfg.dataset_path().exists()
