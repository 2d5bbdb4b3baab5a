"""The ``attention_chunk`` field of the workflow configs reaches the `Transformer`s they build.

Stage 3 (policy and reference), the Stage 1 scorer and the Stage 2 embedding pass (the shared
``ScorerConfig``), the LoRA-SFT baseline and the exact-target scorers of evaluation / Stage 3: the
paper configs ask for 1024, a value set in the config is the built model's ``attention_chunk``, and
a negative one is refused naming the field and the value.
"""
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import eval_paper, sft_paper, stage1_paper, stage2_paper, stage3_paper
from disa_jax import testing
from disa_jax.models import ModelOptions, Transformer
from disa_jax.sft import baseline, lora
from disa_jax.workflows import stage3
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.sft import SftConfig
from disa_jax.workflows.stage1 import Stage1Config, load_reference
from disa_jax.workflows.stage2 import Stage2Config

CHUNK = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
  return testing.save_tiny_checkpoint(str(tmp_path_factory.mktemp("chunk") / "tiny"), "qwen3")


def _eval_config():
  c = eval_paper.get_config("math")
  c.output_dir, c.model_path = "eval/x", "models/x"
  return c


def _stage3(arg: str, **model):
  c = stage3_paper.get_config(arg).to_dict()
  c["model"].update(model)
  return stage3.Stage3Config.from_config(c)


def test_the_paper_configs_ask_for_query_blocks_of_1024():
  assert _stage3("disa,qwen3-4b-base,math").model.attention_chunk == 1024
  assert _stage3("grpo,qwen2.5-7b,code").model.attention_chunk == 1024
  s1 = Stage1Config.from_config(stage1_paper.get_config("qwen2.5-7b,math"))
  s2 = Stage2Config.from_config(stage2_paper.get_config("qwen3-4b-base,math"))
  sft = SftConfig.from_config(sft_paper.get_config("qwen3-4b-base"))
  assert s1.scorer.attention_chunk == s2.embedding.attention_chunk == sft.sft.attention_chunk == 1024
  # The exact target scores enumerable correct sets (short answers): dense.
  assert EvalConfig.from_config(_eval_config()).exact_target.attention_chunk == 0


def test_stage3_policy_and_reference_get_the_chunk(ckpt):
  cfg = _stage3("disa,qwen3-4b-base,math", policy_path=ckpt, attention_chunk=CHUNK)
  policy, reference = stage3._load_models(cfg, None)  # pylint: disable=protected-access
  assert reference is not None  # DISA keeps pi_ref
  assert (policy.options.attention_chunk, reference.options.attention_chunk) == (CHUNK, CHUNK)
  dense, _ = stage3._load_models(  # pylint: disable=protected-access
      _stage3("disa,qwen3-4b-base,math", policy_path=ckpt, attention_chunk=0), None)
  assert dense.options.attention_chunk == 0


def test_stage1_scorer_and_stage2_embedding_get_the_chunk(ckpt):
  c1 = stage1_paper.get_config("qwen3-4b-base,math")
  c1.scorer.attention_chunk, c1.scorer.mesh.num_devices = CHUNK, 1
  assert load_reference(ckpt, Stage1Config.from_config(c1).scorer).options.attention_chunk == CHUNK
  c2 = stage2_paper.get_config("qwen3-4b-base,math")
  c2.embedding.attention_chunk, c2.embedding.mesh.num_devices = CHUNK + 1, 1
  emb = Stage2Config.from_config(c2).embedding
  assert load_reference(ckpt, emb).options.attention_chunk == CHUNK + 1


def test_sft_model_and_its_merged_export_get_the_chunk(ckpt):
  c = sft_paper.get_config("qwen3-4b-base")
  c.sft.attention_chunk = CHUNK
  cfg = SftConfig.from_config(c).sft
  graphdef, adapters, rest, _ = baseline._lora_model(  # pylint: disable=protected-access
      ckpt, cfg, jnp.float32, None)
  model = nnx.merge(graphdef, adapters, rest)
  assert model.options.attention_chunk == CHUNK
  assert lora.merge_lora(model).options.attention_chunk == CHUNK


def test_exact_target_models_get_the_chunk(ckpt):
  c = _eval_config()
  c.exact_target.attention_chunk = CHUNK
  assert EvalConfig.from_config(c).exact_target.load_model(ckpt).options.attention_chunk == CHUNK


@pytest.mark.parametrize("cls, make, section, match", [
    (stage3.Stage3Config, lambda: stage3_paper.get_config("disa,qwen3-4b-base,math"), "model",
     r"config\.model\.attention_chunk must be an int >= 0 .*got -1"),
    (Stage1Config, lambda: stage1_paper.get_config("qwen3-4b-base,math"), "scorer",
     r"config\.scorer\.attention_chunk must be an int >= 0 .*got -1"),
    (Stage2Config, lambda: stage2_paper.get_config("qwen3-4b-base,math"), "embedding",
     r"config\.embedding: scorer\.attention_chunk must be an int >= 0 .*got -1"),
    (SftConfig, lambda: sft_paper.get_config("qwen3-4b-base"), "sft",
     r"config\.sft: LoRASFTConfig\.attention_chunk must be an int >= 0 .*got -1"),
    (EvalConfig, _eval_config, "exact_target",
     r"config\.exact_target\.attention_chunk must be an int >= 0 .*got -1"),
])
def test_a_negative_chunk_is_refused_naming_the_field(cls, make, section, match):
  raw = make().to_dict()
  cls.from_config(raw)  # the paper config itself is valid
  raw[section]["attention_chunk"] = -1
  with pytest.raises(ValueError, match=match):
    cls.from_config(raw)


def test_the_model_refuses_a_negative_chunk_and_a_bool():
  config = testing.tiny_config("qwen3")
  with pytest.raises(ValueError, match=r"Transformer attention_chunk must be an int >= 0 .*got -2"):
    Transformer(config, rngs=nnx.Rngs(0), options=ModelOptions(attention_chunk=-2))
  with pytest.raises(ValueError, match=r"config\.model\.attention_chunk must be int, got True"):
    _stage3("disa,qwen3-4b-base,math", attention_chunk=True)
