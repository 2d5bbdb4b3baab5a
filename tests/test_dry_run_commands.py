"""Every documented paper command passes its own `--dry_run` against the real models' configs.

The commands are read from the docs: each ``launch/<cmd>.py`` / ``launch.<cmd>`` line with a
``--config=configs/*_paper.py:...`` in README.md, docs/*.md and configs/README.md (code blocks and
inline code), and every config string of configs/README.md's table of the paper's experiments.
Each runs in this process (`disa_jax.launcher.invoke`, the launch script itself) in a directory
holding what it reads: the model folders carry the real ``config.json`` / ``generation_config.json``
(tests/fixtures/model_configs/, no weights), prompt and benchmark files are empty, and a DISA run's
anchor is fitted-shaped with the run's label facts and its reference's hidden size. A command whose
doc sets ``CUDA_VISIBLE_DEVICES`` runs in a subprocess with that many devices.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags
from flax import nnx
from ml_collections import config_flags

from configs import common
from disa_jax import launcher
from disa_jax.anchor import Anchor, AnchorMeta, AnchorMLP, EmbeddingSpec
from disa_jax.models import load_config
from disa_jax.workflows.evaluation import EvalConfig
from disa_jax.workflows.nstudy import NStudyConfig
from disa_jax.workflows.preflight import CHECKS, PreflightError, field, preflight, served_context
from disa_jax.workflows.sft import SftConfig
from disa_jax.workflows.stage1 import Stage1Config
from disa_jax.workflows.stage2 import Stage2Config
from disa_jax.workflows.stage3 import Stage3Config

ROOT = Path(__file__).resolve().parents[1]
MODEL_CONFIGS = ROOT / "tests" / "fixtures" / "model_configs"
DOCS = ("README.md", "configs/README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                  for p in (ROOT / "docs").glob("*.md")))
TYPES = {"stage1": Stage1Config, "stage2": Stage2Config, "train": Stage3Config, "sft": SftConfig,
         "evaluate": EvalConfig, "nstudy": NStudyConfig}
SCRIPT_OF = {"stage1_paper": "stage1", "stage2_paper": "stage2", "stage3_paper": "train",
             "sft_paper": "sft", "eval_paper": "evaluate", "nstudy_paper": "nstudy"}
# Input fields that are directories (the others are files), beside the model folders.
DIRECTORIES = {"stage1_path", "data.replay_path", "run_dir"}
# Doc commands that are not runnable as written, and why.
NOT_COMMANDS = {"--config.train.objective.name=disa_huber": "docs/objectives.md's example "
                "objective, registered only once the page's class is added "
                "(tests/rl/test_objectives_doc.py)"}
COMMAND = re.compile(r"launch(?:/(?P<script>\w+)\.py|\.(?P<module>\w+))\s+"
                     r"(?P<args>--config=configs/(?P<config>\w+_paper)\.py:\S+.*)")


def _exports(text: str) -> dict[str, str]:
  """The doc's ``export NAME=value ...`` variables."""
  return dict(kv.split("=", 1) for m in re.finditer(r"export ((?:\w+=\S+ ?)+)", text)
              for kv in m.group(1).split())


def _doc_commands(doc: str) -> list[tuple[str, str, list[str], int | None]]:
  """(id, script, argv, devices) of every paper command in ``doc``."""
  text = (ROOT / doc).read_text()
  blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
  prose = re.sub(r"```.*?```", "", text, flags=re.S)
  lines = [l for b in blocks for l in b.replace("\\\n", " ").splitlines()]
  lines += [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]
  out = []
  for line in lines:
    m = COMMAND.search(line)
    if not m or any(k in line for k in NOT_COMMANDS):
      continue
    gpus = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+)", line[:m.start()])
    argv = [a for a in shlex.split(m.group("args").split(" #")[0]) if not a.endswith("...")]
    script = m.group("script") or m.group("module")
    out.append((f"{doc}:{script}:{' '.join(argv[:2])}", script, _with_outputs(script, argv),
                len(gpus.group(1).split(",")) if gpus else None))
  return out


def _with_outputs(script: str, argv: list[str]) -> list[str]:
  """``argv`` with the outputs a run needs where the doc leaves them out (a table's config string,
  a command abbreviated with '...'): a workdir; a model and an output directory to evaluate."""
  slug = re.sub(r"\W+", "_", argv[0].split(":", 1)[1])
  given = {a.split("=", 1)[0] for a in argv}
  extra = {"train": {"--workdir": f"runs/{slug}"},
           "evaluate": {"--config.model_path": "models/Qwen3-4B-Base",
                        "--config.output_dir": f"eval/{slug}"}}.get(script, {})
  if script == "evaluate" and "--config.run_dir" in given:
    extra.pop("--config.model_path")
  return argv + [f"{k}={v}" for k, v in extra.items() if k not in given]


def _table_commands() -> list[tuple[str, str, list[str], int | None]]:
  """Every config string of configs/README.md's table of the paper's experiments, braces expanded,
  with the outputs a run needs (a workdir; a model and an output directory to evaluate)."""
  text = (ROOT / "configs" / "README.md").read_text()
  table = text[text.index("## The paper's experiments"):text.index("## Implementation presets")]
  found = re.findall(r"`configs/(\w+_paper)\.py:([^`]+)`", table)
  strings = {(config, one) for config, arg in found for one in _expand(arg)}
  return [(f"table:{config}:{arg}", SCRIPT_OF[config],
           _with_outputs(SCRIPT_OF[config], [f"--config=configs/{config}.py:{arg}"]), None)
          for config, arg in sorted(strings)]


def _expand(text: str) -> list[str]:
  """Shell-style brace expansion: ``'a,{b,c}'`` -> ``['a,b', 'a,c']``."""
  m = re.search(r"\{([^{}]*)\}", text)
  if m is None:
    return [text]
  return [x for option in m.group(1).split(",")
          for x in _expand(text[:m.start()] + option + text[m.end():])]


COMMANDS = [c for doc in DOCS for c in _doc_commands(doc)] + _table_commands()


def _rooted(argv: list[str], root: Path, env: dict[str, str]) -> list[str]:
  """``argv`` with the doc's variables expanded and absolute paths moved under ``root``."""
  out = []
  for arg in argv:
    for name, value in env.items():
      arg = arg.replace(f"${name}", value)
    flag, sep, value = arg.partition("=")
    if value.startswith("/"):
      value = f"{root}{value}"
    out.append(flag + sep + value.replace("'/", f"'{root}/"))
  return out


def typed_config(script: str, argv: list[str]):
  """The command's typed config, parsed as its launcher parses it (a private FlagValues)."""
  fv = flags.FlagValues()
  argv = [launcher.resolve_config_arg(a) for a in argv]
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=fv,
                                           sys_argv=[script, *argv])
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  fv([script, *argv])
  config = holder.value
  if fv["workdir"].value:
    config.workdir = fv["workdir"].value
  return TYPES[script].from_config(config)


def _model(path: str) -> None:
  """A model folder with the vendored config of the model its name names."""
  src = MODEL_CONFIGS / Path(path).name
  assert src.is_dir(), f"no vendored config for {path!r} in {MODEL_CONFIGS}"
  shutil.copytree(src, path, dirs_exist_ok=True)


def _anchor(cfg: Stage3Config) -> None:
  """An anchor with the run's label facts, fitted on its reference's prompt embeddings."""
  obj, hidden = cfg.train.objective, load_config(cfg.model.reference).hidden_size
  meta = AnchorMeta(embedding=EmbeddingSpec("model_mean_pool", hidden, cfg.model.reference,
                                            rendering=cfg.data.rendering),
                    beta=obj.beta, reward_transform=obj.reward_transform, label_scale=obj.scale,
                    hidden_sizes=(8,))
  Anchor(AnchorMLP(hidden, (8,), "relu", rngs=nnx.Rngs(0)), meta).save(Path(cfg.data.anchor_path))


def make_inputs(cfg) -> None:
  """Everything ``cfg`` (a typed config, paths relative to the working directory) reads."""
  if isinstance(cfg, NStudyConfig):
    return make_inputs(cfg.stage1)
  checks = CHECKS[type(cfg).__name__]
  for name in checks.inputs:
    value = field(cfg, name)
    paths = value.values() if isinstance(value, dict) else value if isinstance(value, tuple) else (
        value,)
    for path in filter(None, paths):
      if name in checks.models:
        _model(path)
      elif name == "data.anchor_path":
        _model(cfg.model.reference)
        _anchor(cfg)
      elif name in DIRECTORIES:
        Path(path).mkdir(parents=True, exist_ok=True)
      else:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()
  if isinstance(cfg, EvalConfig) and cfg.run_dir:  # a Stage 3 workdir: its config names the policy
    _model("models/Qwen3-4B-Base")
    (Path(cfg.run_dir) / "config.json").write_text(
        json.dumps({"model": {"policy_path": os.path.abspath("models/Qwen3-4B-Base")}}))


def _subprocess_dry_run(script: str, argv: list[str], devices: int, cwd: Path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  out = subprocess.run([sys.executable, str(ROOT / "launch" / f"{script}.py"), *argv, "--dry_run"],
                       env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
  return out.returncode, out.stdout, out.stderr


def test_the_list_is_the_documented_one():
  docs = {c[0].split(":")[0] for c in COMMANDS}
  assert {"README.md", "docs/real_checkpoints.md", "docs/cluster.md", "table"} <= docs, docs
  scripts = {c[1] for c in COMMANDS}
  assert scripts == set(TYPES), scripts  # every paper command kind appears
  headline = [c for c in COMMANDS if c[0].startswith("README.md:train")]
  assert headline and "disa,qwen3-4b-base,math" in headline[0][2][0]


def test_contexts_are_the_vendored_models():
  for name, context in common.CONTEXTS.items():
    path = common.BACKBONES.get(name) or common.PROPOSALS[name][0]
    assert served_context(str(MODEL_CONFIGS / Path(path).name)) == context, name


@pytest.mark.parametrize("command", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_passes_its_dry_run(command, tmp_path, monkeypatch, capfd):
  name, script, argv, devices = command
  doc = name.split(":")[0]
  env = {k: f"{tmp_path}{v}" for k, v in
         (_exports((ROOT / doc).read_text()) if doc != "table" else {}).items()}
  argv = _rooted(argv, tmp_path, env)
  monkeypatch.chdir(tmp_path)
  make_inputs(typed_config(script, argv))
  if devices not in (None, 8):  # the test process has 8 (tests/conftest.py)
    rc, out, err = _subprocess_dry_run(script, argv, devices, tmp_path)
  else:
    capfd.readouterr()
    rc = launcher.invoke(str(ROOT / "launch" / f"{script}.py"), [*argv, "--dry_run"])
    out, err = capfd.readouterr()
  assert rc == 0, f"{name}\n{' '.join(argv)}\n{err[-3000:]}"
  printed = json.loads(out)
  if script == "train" and "qwen3-4b-base" in argv[0]:  # the paper's values, within the context
    assert printed["engine"]["vllm_kwargs"]["max_model_len"] == 32768
    assert printed["train"]["validation"]["max_tokens"] == 32768
    assert "vLLM ends a response there (finish reason 'length'), after at least 30720" in err


def test_lengths_are_checked_against_the_generating_model(tmp_path, monkeypatch):
  """The MoE proposal is read for its lengths only; the JAX reader's models must be dense."""
  monkeypatch.chdir(tmp_path)
  argv = ["--config=configs/stage1_paper.py:qwen3-4b-base,math"]
  cfg = typed_config("stage1", argv)
  make_inputs(cfg)
  preflight(cfg)  # the 235B MoE proposal: max_model_len 34816 within its 262144
  moe = dataclasses.replace(cfg, reference_path=cfg.proposal_path)
  with pytest.raises(PreflightError, match=r"reference_path='models/Qwen3-235B-A22B-Instruct-2507'"
                     r": config.json model_type='qwen3_moe' is not supported"):
    preflight(moe)
  long = dataclasses.replace(cfg, engine=dataclasses.replace(
      cfg.engine, vllm_kwargs={**cfg.engine.vllm_kwargs, "max_model_len": 300000}))
  with pytest.raises(PreflightError, match=r"max_model_len=300000 > the context of proposal_path="
                     r"'models/Qwen3-235B-A22B-Instruct-2507', 262144 tokens"):
    preflight(long)
  allowed = dataclasses.replace(long, engine=dataclasses.replace(
      long.engine, process=dataclasses.replace(
          long.engine.process, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})))
  preflight(allowed)  # the variable the error names does what it says


def test_evaluation_lengths_follow_the_served_model(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  argv = ["--config=configs/eval_paper.py:math", "--config.model_path=models/Qwen3-4B-Base",
          "--config.output_dir=eval/q3"]
  cfg = typed_config("evaluate", argv)
  make_inputs(cfg)
  notes = preflight(cfg)  # 4096 + 32768 = 36864 > 32768: vLLM ends responses at the context
  assert any("max_prompt_len + max_tokens = 36864 > max_model_len=32768, the context of "
             "model_path='models/Qwen3-4B-Base'" in n for n in notes), notes
  short = dataclasses.replace(cfg, engine=dataclasses.replace(
      cfg.engine, vllm_kwargs={**cfg.engine.vllm_kwargs, "max_model_len": 8192}))
  with pytest.raises(PreflightError, match=r"max_prompt_len \+ max_tokens = 36864 > engine."
                     r"vllm_kwargs.max_model_len=8192; set engine.vllm_kwargs.max_model_len=32768"):
    preflight(short)
