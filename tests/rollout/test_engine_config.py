"""The engine section: open vllm_kwargs / process.env from the command line, their checks, the
enforce_eager default, and the GPU-placement refusal (no GPU needed)."""
import pytest
from absl import flags
from ml_collections import ConfigDict
from ml_collections import config_flags

from configs import common, stage3_paper
from disa_jax import config as config_lib
from disa_jax.rollout import engines
from disa_jax.rollout.engines import EngineConfig, check_gpu_placement
from disa_jax.rollout.process import ProcessOptions
from disa_jax.rollout.vllm_engine import VllmEngine, default_enforce_eager
from disa_jax.workflows.stage3 import Stage3Config

CONFIG = '''
from configs import common
import ml_collections
def get_config():
  c = ml_collections.ConfigDict()
  c.engine = common.engine("vllm")
  return c
'''


def _parse(tmp_path, *overrides) -> EngineConfig:
  """The config file through ml_collections' flag parser (as the launchers use it), converted."""
  path = tmp_path / "cfg.py"
  path.write_text(CONFIG)
  argv = ["prog", f"--config={path}", *overrides]
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "test", flag_values=fv, sys_argv=argv)
  fv(argv)
  return config_lib.from_mapping(EngineConfig, fv.config.engine, "config.engine")


def test_any_vllm_keyword_and_env_var_pass_through_the_command_line(tmp_path):
  e = _parse(tmp_path, "--config.engine.vllm_kwargs.enforce_eager=False",
             "--config.engine.vllm_kwargs.kv_cache_dtype=fp8",
             "--config.engine.vllm_kwargs.max_num_seqs=8",
             "--config.engine.process.env.VLLM_ATTENTION_BACKEND=FLASHINFER",
             "--config.engine.process.env.OMP_NUM_THREADS=4")
  assert e.vllm_kwargs["enforce_eager"] is False and e.vllm_kwargs["kv_cache_dtype"] == "fp8"
  assert e.vllm_kwargs["max_num_seqs"] == 8 and e.vllm_kwargs["tensor_parallel_size"] == 1
  assert e.process.env == {"VLLM_ATTENTION_BACKEND": "FLASHINFER", "OMP_NUM_THREADS": "4"}
  # Other sections stay closed: a typo is still refused by the flag parser.
  with pytest.raises(AttributeError, match="kindd"):
    _parse(tmp_path, "--config.engine.kindd=jax")


def test_open_sections_take_scalars_only_naming_the_field(tmp_path):
  with pytest.raises(ValueError, match=r"engine\.vllm_kwargs\.hf_overrides must be a bool, int"):
    _parse(tmp_path, "--config.engine.vllm_kwargs.hf_overrides={'a': 1}")
  with pytest.raises(ValueError, match=r"process\.env\.X must be a string or number"):
    ProcessOptions(env={"X": True})
  with pytest.raises(ValueError, match=r"process\.env\.Y must be a bool, int, float or str, got"):
    ProcessOptions(env={"Y": [1]})


def test_copy_threads_is_a_checked_process_option(tmp_path):
  """``engine.process.copy_threads`` (threads copying a weight push into shared memory) is set
  from the command line and refused, naming the field and the value, unless an int >= 0."""
  assert _parse(tmp_path).process.copy_threads == 0  # min(8, CPU count)
  assert _parse(tmp_path, "--config.engine.process.copy_threads=3").process.copy_threads == 3
  with pytest.raises(ValueError, match=r"config\.engine\.process\.copy_threads must be an int "
                                       r">= 0 .*got -1"):
    _parse(tmp_path, "--config.engine.process.copy_threads=-1")
  for bad in (True, 2.0, "4"):
    with pytest.raises(ValueError, match=r"process\.copy_threads must be an int >= 0 .*got "):
      ProcessOptions(copy_threads=bad)


def test_enforce_eager_defaults_to_false_on_cuda():
  assert default_enforce_eager(cuda=True) is False
  assert default_enforce_eager(cuda=False) is True
  assert VllmEngine.__init__.__kwdefaults__["enforce_eager"] is None  # resolved per platform


def test_openai_kind_needs_an_endpoint():
  with pytest.raises(ValueError, match=r"engine\.openai\.base_url must start with http"):
    EngineConfig(kind="openai")
  with pytest.raises(ValueError, match=r"engine\.openai\.model must name"):
    config_lib.from_mapping(EngineConfig, {"kind": "openai", "openai": {"base_url": "http://h/v1"}})
  EngineConfig()  # the default kind needs no endpoint


@pytest.mark.parametrize("trainer,worker,ok", [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, {}, False),  # the single-node command
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}, True),
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}, {"CUDA_VISIBLE_DEVICES": "5,6"}, False),
    ({}, {}, False),  # the trainer takes all GPUs
    ({}, {"CUDA_VISIBLE_DEVICES": "6,7"}, False),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "DISA_GENERATION_SHARES_GPUS": "1"}, {}, True),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cpu"}, {}, True),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "JAX_PLATFORMS": "cuda"}, {}, False),
    ({"DISA_LOCAL_DEVICE_IDS": "0,1,2,3,4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}, True),  # sbatch
    ({"DISA_LOCAL_DEVICE_IDS": "0,1,2,3,4,5"}, {}, False),
    ({"CUDA_VISIBLE_DEVICES": "2,3,4,5", "DISA_LOCAL_DEVICE_IDS": "0,1"},
     {"CUDA_VISIBLE_DEVICES": "4,5"}, True),
    ({"CUDA_VISIBLE_DEVICES": "2,3,4,5", "DISA_LOCAL_DEVICE_IDS": "0,3"},
     {"CUDA_VISIBLE_DEVICES": "4,5"}, False)])
def test_gpu_placement(trainer, worker, ok):
  if ok:
    check_gpu_placement("vllm", worker, trainer, gpus_present=True)
  else:
    with pytest.raises(ValueError, match=r"would share the trainer's GPUs.*DISA_GENERATION_GPUS"):
      check_gpu_placement("vllm", worker, trainer, gpus_present=True)
  check_gpu_placement("vllm", worker, trainer, gpus_present=False)  # no GPU: nothing to share
  check_gpu_placement("openai", worker, trainer, gpus_present=True)  # no local process


def test_engine_config_refuses_before_starting_a_process(monkeypatch, tmp_path):
  monkeypatch.setattr(engines, "nvidia_gpus_present", lambda: True)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv("DISA_GENERATION_SHARES_GPUS", raising=False)
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
  monkeypatch.delenv("DISA_GENERATION_GPUS", raising=False)
  started = []
  monkeypatch.setattr(engines, "make_engine", lambda *a, **k: started.append(a))
  with pytest.raises(ValueError, match="DISA_GENERATION_GPUS"):
    EngineConfig(kind="jax").make(str(tmp_path))
  monkeypatch.setenv("DISA_GENERATION_GPUS", "2,3")
  EngineConfig(kind="jax").make(str(tmp_path))
  assert started == [("jax", str(tmp_path))]


def test_stage3_refuses_a_served_policy():
  c = stage3_paper.get_config("grpo,qwen3-4b-base,math")
  c.engine.kind = "openai"
  c.engine.openai.base_url, c.engine.openai.model = "http://h/v1", "m"
  with pytest.raises(ValueError, match=r"engine\.kind='openai' cannot serve the Stage 3 policy"):
    Stage3Config.from_config(c)



def test_open_sections_stay_open_when_a_config_reassigns_them():
  """Config files and tests assign whole sections (`c.engine.vllm_kwargs = ConfigDict({...})`)."""
  e = common.engine("vllm")
  e.vllm_kwargs = ConfigDict({"max_model_len": 512})
  e.process.env = {"A": "1"}
  assert type(e.vllm_kwargs) is common.OpenSection and type(e.process.env) is common.OpenSection
  assert e.vllm_kwargs.get_type("enforce_eager") is object  # an undeclared key is still taken
  assert "enforce_eager" in e.vllm_kwargs and e.vllm_kwargs.max_model_len == 512
