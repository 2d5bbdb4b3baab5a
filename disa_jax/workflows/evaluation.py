"""The evaluation command: one checkpoint x a benchmark suite -> per-benchmark and suite tables.

`run_evaluation(EvalConfig)` serves the checkpoint (any local HF directory, or a Stage 3 run whose
policy checkpoint is first exported to ``<output_dir>/policy_step<k>`` by `workflows.export`) with
a rollout engine (vLLM by default), samples k responses per problem with the paper's protocol
(temperature 0.6, top-p 0.95, the configured response length; k = 8 for math, Mean@8; k = 16 for
code, pass@1 and pass@16), grades them (math-verify / execution / a registered task reward) through
`disa_jax.eval.runner.evaluate_benchmark`, and optionally scores diversity (the local metric:
distinct final answers and mean pairwise distance; the App. D.5 LLM judge on an OpenAI-compatible
endpoint). For a task whose correct set can be enumerated (`disa_jax.tasks`; the measures of its
``measures`` hook, `disa_jax.eval.exact`), ``exact_target`` adds the exact measures against the
reward-tilted target: P(correct), the entropy over correct answers, and KL(pi || pi~) with its
decomposition. Output directory:

    <name>.json, <name>.md        metrics (and per-problem correctness, diversity) of one benchmark
    <name>_responses.jsonl        every response with its correctness, appended ``save_every``
                                  problems at a time (a preempted or killed evaluation resumes
                                  from its last whole row; the samples do not depend on where)
    summary.md, summary.json      the suite tables: Mean@k over the math benchmarks, pass@1 and
                                  pass@k over the code benchmarks, each with an Average column

    <name>.identity.json          what <name>.json was computed from: the served model (path and
                                  content hash: a Stage 3 run's export names its step), the
                                  benchmark file (hash), the sampling, grading and engine settings

A rerun skips the benchmarks whose results exist with the same identity and rebuilds the suite
tables; one whose identity differs (e.g. ``run_step=-1`` after training moved on) stops naming every
differing field, or with ``overwrite=True`` evaluates that benchmark again. One evaluation at a time
holds ``<output_dir>/.lock``.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from disa_jax import artifacts, codec
from disa_jax import config as config_lib
from disa_jax import models, paths, preemption, tasks
from disa_jax.checkpoint import identity, selection
from disa_jax.checkpoint.lock import OutputLock
from disa_jax.data.prompting import check_rendering, encode_prompt
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.eval import diversity, metrics, runner
from disa_jax.eval.exact import ExactMeasures, ExactTargetConfig
from disa_jax.rollout import stop_ids
from disa_jax.rollout.engines import EngineConfig
from disa_jax.tasks.prompts import benchmark_formats, load_prompts
from disa_jax.tasks.registry import import_reward_plugins
from disa_jax.workflows import export
from disa_jax.workflows.export import EXPORT_DTYPES



@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig(config_lib.Section):
  """Typed view of `configs/eval_paper.py` (the fields are documented there)."""

  output_dir: str
  model_path: str = ""
  run_dir: str = ""
  run_checkpoint: str = "best"
  benchmarks: dict = dataclasses.field(default_factory=dict)
  label: str = ""
  limit: int = 0
  save_every: int = codec.field(default=64, omit=64)  # (recorded only where set: not a result's)
  math_k: int = 8
  code_k: int = 16
  temperature: float = 0.6
  top_p: float = 0.95
  max_tokens: int = 32768
  seed: int = 0
  stop_token_ids: tuple[int, ...] = ()
  rendering: str = "chat_template"
  max_prompt_len: int = 4096
  reward_plugins: tuple[str, ...] = ()
  engine: EngineConfig = EngineConfig()
  exact_target: ExactTargetConfig = ExactTargetConfig()
  local_diversity: bool = False
  judge_url: str = ""
  judge_model: str = "gpt-4o-mini"
  judge_api_key_env: str = "OPENAI_API_KEY"
  judge_cache_dir: str = ""
  diversity_benchmarks: tuple[str, ...] = ("aime24", "aime25")
  diversity_k: int = 8
  export_dtype: str = "bfloat16"
  overwrite: bool = False

  def __post_init__(self):
    if not self.output_dir:
      raise ValueError("output_dir is required (a local path), got ''")
    if bool(self.model_path) == bool(self.run_dir):
      raise ValueError(f"set exactly one of model_path (an HF directory) and run_dir (a Stage 3 "
                       f"workdir); got model_path={self.model_path!r}, run_dir={self.run_dir!r}")
    check_rendering(self.rendering)
    selection.check_which(self.run_checkpoint, "run_checkpoint")
    if self.export_dtype not in EXPORT_DTYPES:
      raise ValueError(f"export_dtype must be one of {EXPORT_DTYPES}, got {self.export_dtype!r}")
    for name, path in self.benchmarks.items():
      if not isinstance(path, str):
        raise ValueError(f"benchmarks.{name} must be a path string ('' skips it), got {path!r}")
    if not any(self.benchmarks.values()):
      raise ValueError("benchmarks: every path is empty; set at least one benchmarks.<name>=PATH")
    if self.save_every < 1:
      raise ValueError(f"save_every must be >= 1 (problems per save), got {self.save_every!r}")
    if self.math_k < 1 or self.code_k < 1 or self.diversity_k < 2 or self.limit < 0:
      raise ValueError(f"math_k and code_k must be >= 1, diversity_k >= 2, limit >= 0; got "
                       f"{self.math_k}, {self.code_k}, {self.diversity_k}, {self.limit}")


  @property
  def method(self) -> str:
    """The row name of the tables."""
    return self.label or os.path.basename(os.path.normpath(self.model_path or self.run_dir))


@dataclasses.dataclass(frozen=True, eq=False)
class BenchmarkEval:
  """One benchmark of an evaluation, persisted as ``<output_dir>/<name>.json`` (beside
  ``<name>.md`` and ``<name>_responses.jsonl``).

  Attributes:
    name, ability, path: the benchmark, its records' ability and its prompt file.
    method: the evaluated model's row name.
    k: samples per problem; n_problems: P.
    metrics: Mean@k / pass@k / ... by name (`disa_jax.eval.metrics`).
    prompt_ids: ``[P]`` the problems.
    correct: ``[P, k]`` int, 1 where a sample was graded correct.
    sampling: the sampling parameters (`SamplingParams.to_dict`).
    diversity: the local / judge diversity results (empty when off).
    exact: the exact measures against the tilted target (None when off).
  """
  name: str
  ability: str
  metrics: Mapping[str, float]
  prompt_ids: tuple[str, ...] = codec.field(rows="per_prompt", key="prompt_id")
  correct: np.ndarray = codec.field(rows="per_prompt", dtype=np.int64)
  k: int
  n_problems: int
  path: str
  method: str
  sampling: Mapping[str, Any]
  diversity: Mapping[str, Any]
  exact: ExactMeasures | None = codec.field(omit=None)

  __eq__ = artifacts.fields_equal

  def __post_init__(self):
    if not isinstance(self.sampling.get("stop_token_ids"), (list, tuple)):
      raise ValueError("field 'sampling.stop_token_ids' is missing")

  @property
  def stop_token_ids(self) -> list[int]:
    return list(self.sampling["stop_token_ids"])

  def save(self, out_dir: str | Path) -> None:
    """``<out_dir>/<name>.json``, written last (atomically): it marks the benchmark done."""
    codec.save(self, paths.as_path(out_dir) / f"{self.name}.json")

  @classmethod
  def load(cls, out_dir: str | Path, name: str) -> "BenchmarkEval":
    return codec.load(cls, paths.as_path(out_dir) / f"{name}.json",
                      f"the evaluation of benchmark {name!r}")


@dataclasses.dataclass(frozen=True)
class EvalResult:
  """An evaluation: what `run_evaluation` returns, persisted as ``<output_dir>/summary.json`` (with
  summary.md) beside its benchmarks' files.

  Attributes:
    output_dir: the evaluation's directory.
    method: the row name of the tables.
    model_path: the HF directory served.
    checkpoint: the Stage 3 checkpoint evaluated and why (None for ``model_path``).
    tables: per metric, the benchmarks' values (`disa_jax.eval.metrics.results_json`).
    evaluated_now: the benchmarks the call that wrote it evaluated (the rest were resumed).
    benchmarks: every benchmark's results, by name.
  """
  output_dir: Path = codec.field(stored=False)
  method: str
  model_path: str
  checkpoint: selection.Choice | None
  tables: Mapping[str, Mapping[str, Any]]
  evaluated_now: tuple[str, ...]
  benchmarks: Mapping[str, BenchmarkEval] = codec.field(stored=False)

  FILE = "summary.json"

  def to_json(self) -> dict[str, Any]:
    """summary.json: the tables, and each benchmark's metrics, diversity and exact means."""
    b = self.benchmarks
    return {"method": self.method, "model_path": self.model_path,
            "checkpoint": codec.encode(self.checkpoint),
            "tables": {m: dict(v) for m, v in self.tables.items()},
            "benchmarks": {n: dict(o.metrics) for n, o in b.items()},
            "diversity": {n: dict(o.diversity) for n, o in b.items() if o.diversity},
            "exact": {n: o.exact.to_json(per_prompt=False) for n, o in b.items()
                      if o.exact is not None},
            "evaluated_now": list(self.evaluated_now),
            "stop_token_ids": {n: o.stop_token_ids for n, o in b.items()}}

  def save(self) -> None:
    artifacts.write_json(self.output_dir / self.FILE, self.to_json())

  @classmethod
  def load(cls, output_dir: str | Path) -> "EvalResult":
    """The evaluation in ``output_dir``: summary.json and its benchmarks' ``<name>.json``."""
    path = paths.as_path(output_dir) / cls.FILE
    obj = artifacts.read_json(path, "the evaluation")
    return codec.decode(cls, obj, path, output_dir=paths.as_path(output_dir), benchmarks={
        n: BenchmarkEval.load(output_dir, n) for n in artifacts.field(obj, "benchmarks", path, dict)})


def resolve_model(cfg: EvalConfig) -> tuple[str, selection.Choice | None]:
  """The HF directory to serve: ``model_path``, or the run's ``run_checkpoint`` exported to
  output_dir, with the choice (None for ``model_path``)."""
  if cfg.model_path:
    return cfg.model_path, None
  choice = selection.choose_step(cfg.run_dir, cfg.run_checkpoint)
  print(f"evaluation: {cfg.run_dir} checkpoint {choice.step}: {choice.reason}", flush=True)
  out = Path(cfg.output_dir) / f"policy_step{choice.step}"
  if not (out / "export_info.json").exists():
    export.export_policy(cfg.run_dir, out, step=choice.step, dtype=cfg.export_dtype,
                         overwrite_partial=True, choice=choice)
  return str(out), choice


def _diversity(cfg: EvalConfig, name: str, records, responses) -> dict[str, Any]:
  """Local and judge diversity over the first ``diversity_k`` responses of each problem."""
  out: dict[str, Any] = {}
  rows = [r[:cfg.diversity_k] for r in responses]
  if cfg.local_diversity:
    per = [diversity.local_diversity(r) for r in rows]
    out["local"] = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
  if cfg.judge_url and name in cfg.diversity_benchmarks:
    judge = diversity.DiversityJudge(cfg.judge_url, cfg.judge_model,
                                     os.environ.get(cfg.judge_api_key_env) or None,
                                     cache_dir=cfg.judge_cache_dir or None)
    problems = [str(rec.extra.get("problem") or rec.prompt_text()) for rec in records]
    scores = judge.score_many(problems, rows)  # [P]
    out["judge"] = {"model": cfg.judge_model, "mean": float(scores.mean()),
                    "std": float(scores.std(ddof=1)) if scores.size > 1 else 0.0,
                    "scores": scores.tolist()}
  return out


class _Scorers:
  """The policy / reference scorers of the exact evaluation, built on first use."""

  def __init__(self, cfg: EvalConfig, model_path: str, pad_id: int):
    self.cfg, self.model_path, self.pad_id = cfg, model_path, pad_id
    self._pair = None

  def get(self):
    if self._pair is None:
      ec = self.cfg.exact_target
      make = lambda path: ec.scorer(ec.load_model(path), self.pad_id)
      self._pair = (make(self.model_path), make(self.cfg.exact_target.reference_path))
    return self._pair


def _saved_rows(path: Path, records, k: int) -> list[runner.GradedRow]:
  """The graded rows an interrupted evaluation of this benchmark saved: the longest prefix of
  ``path``'s lines that are whole rows of ``records`` in order (a torn last line, written when the
  run was killed, and anything after it is cut off the file: those problems are sampled again)."""
  if not path.exists():
    return []
  rows, lines = [], path.read_text(encoding="utf-8").splitlines(keepends=True)
  for line, rec in zip(lines, records):
    try:
      d = json.loads(line)
      row = runner.GradedRow(d["prompt_id"], tuple(d["responses"]),
                             tuple(bool(c) for c in d["correct"]), int(d["grade_errors"]))
    except (ValueError, KeyError, TypeError):
      break
    if not line.endswith("\n") or row.prompt_id != rec.prompt_id or len(row.correct) != k:
      break
    rows.append(row)
  if len(rows) < len(lines):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(lines[:len(rows)]), encoding="utf-8")
    paths.replace(tmp, path)
  return rows


def _sample_benchmark(cfg: EvalConfig, name: str, records, token_ids, params, engine, tokenizer,
                      out_dir: Path) -> list[runner.GradedRow]:
  """Every record's graded row: those saved by an interrupted run, then the rest ``save_every``
  problems at a time, each slice's rows appended to ``<name>_responses.jsonl`` as it is graded.

  Raises:
    preemption.Stopped: a SIGTERM / SIGUSR1 arrived; the slices graded so far are saved.
  """
  path = out_dir / f"{name}_responses.jsonl"
  rows = _saved_rows(path, records, params.n)
  for lo in range(len(rows), len(records), cfg.save_every):
    if preemption.agreed():
      raise preemption.Stopped(
          f"evaluate: preempted ({preemption.requested()}) in benchmark {name!r} after {lo} of "
          f"{len(records)} problems (their rows are in {path}); rerun the command to resume")
    hi = min(lo + cfg.save_every, len(records))
    new = runner.sample_and_grade(engine, tokenizer, records[lo:hi], token_ids[lo:hi],
                                  dataclasses.replace(params, prompt_index_offset=lo), name=name,
                                  reward_fn_name=records[0].ability)
    paths.append(path, "".join(json.dumps({"prompt_id": r.prompt_id, "responses": r.responses,
                                           "correct": [int(c) for c in r.correct],
                                           "grade_errors": r.grade_errors}) + "\n" for r in new))
    rows += new
  return rows


def _evaluate_one(cfg: EvalConfig, name: str, path: str, model_path: str, engine, tokenizer,
                  scorers: _Scorers, out_dir: Path) -> BenchmarkEval:
  """Samples, grades and (optionally) scores exactly one benchmark; writes its files."""
  records = load_prompts(path, name if name in benchmark_formats() else "auto",
                                 limit=cfg.limit or None)
  if not records:
    raise ValueError(f"benchmarks.{name}={path!r}: the file holds no prompts")
  ability = runner.benchmark_ability(records, f"benchmarks.{name}={path!r}")
  code = ability == "code"
  k = cfg.code_k if code else cfg.math_k
  params = runner.eval_sampling_params(k, cfg.max_tokens, None, seed=cfg.seed,
                                       temperature=cfg.temperature, top_p=cfg.top_p)
  params = dataclasses.replace(params, stop_token_ids=cfg.stop_token_ids or stop_ids.stop_token_ids(
      tokenizer, model_path, chat_template=cfg.rendering == "chat_template"))
  token_ids = [encode_prompt(tokenizer, r, cfg.rendering, max_len=cfg.max_prompt_len)
               for r in records]
  rows = _sample_benchmark(cfg, name, records, token_ids, params, engine, tokenizer, out_dir)
  res = runner.result_from_rows(name, ability, rows, token_ids, pass_ks=(1, k) if code else None)
  exact = None
  if cfg.exact_target.enabled:
    tracker = tasks.get_task(records[0].ability).measures(
        cfg.exact_target, tokenizer, res.prompt_token_ids, [r.reward_meta() for r in records],
        lambda: scorers.get()[1], max_tokens=cfg.max_tokens)
    if tracker is None:
      raise ValueError(f"exact_target.reference_path is set but benchmark {name!r} has the task "
                       f"{records[0].ability!r}, which has no exact target (its correct set "
                       "cannot be enumerated)")
    exact = tracker.measure(engine, scorers.get()[0], step=0)
  out = BenchmarkEval(name=res.name, ability=res.ability, path=path, method=cfg.method, k=k,
                      n_problems=len(records), metrics=res.metrics,
                      prompt_ids=tuple(res.prompt_ids), correct=res.correct.astype(np.int64),
                      sampling=codec.encode(params),
                      diversity=_diversity(cfg, name, records, res.responses), exact=exact)
  (out_dir / f"{name}.md").write_text(
      f"# {name} ({len(records)} problems, k = {k})\n\n"
      + metrics.markdown_table({cfg.method: res.metrics}, average=False))
  out.save(out_dir)  # written last: marks the benchmark done
  return out


# EvalConfig fields that change a benchmark's results (beside the model and the benchmark file).
IDENTITY_FIELDS = ("limit", "math_k", "code_k", "temperature", "top_p", "max_tokens", "seed",
                   "stop_token_ids", "rendering", "max_prompt_len", "reward_plugins",
                   "exact_target", "local_diversity", "judge_url", "judge_model",
                   "diversity_benchmarks", "diversity_k")
# Engine fields that change the samples (its process options, e.g. timeouts, do not).
ENGINE_FIELDS = ("kind", "dtype", "vllm_kwargs", "jax_kwargs")


def _claim_benchmarks(cfg: EvalConfig, model_path: str, out_dir: Path) -> dict[str, str]:
  """The benchmarks to evaluate now: those without results, or (``overwrite``) with results of
  another identity (`disa_jax.checkpoint.identity`; refused otherwise, naming every field)."""
  config = config_lib.to_dict(cfg)
  # pi_ref and the held-out prompts of the exact measures are inputs too: compared by content, so
  # an evaluation copied elsewhere with its models resumes (`identity`'s docstring).
  model = identity.inputs(model_path=model_path,
                          exact_reference_path=cfg.exact_target.reference_path,
                          exact_heldout_path=cfg.exact_target.heldout_path)
  # An identity file written before these inputs were fingerprinted resumes where it names them at
  # the same place (its exact_target section is still compared as it was written).
  earlier = lambda missing: identity.added_inputs(model, missing, "exact_")
  todo = {}
  for name, path in cfg.benchmarks.items():
    if not path:
      continue
    files = [out_dir / f"{name}{ext}" for ext in (".json", ".md", "_responses.jsonl")]
    ident = {**model, **identity.inputs(benchmark_path=path),
             **{f: config[f] for f in IDENTITY_FIELDS},
             "exact_target": config["exact_target"],
             **{f"engine.{f}": config["engine"][f] for f in ENGINE_FIELDS}}

    state = identity.claim_output(out_dir / f"{name}.identity.json", ident, overwrite=cfg.overwrite,
                                  has_output=files[0].exists(), recorded=earlier,
                                  discard=lambda files=files: identity.remove_paths(files))
    if state != "resumed" or not files[0].exists():
      todo[name] = path
  return todo


def run_evaluation(cfg: EvalConfig, *, engine: Any = None) -> EvalResult:
  """Evaluates (or resumes evaluating) the suite; returns it (`EvalResult`, written to
  summary.json).

  Args:
    cfg: the evaluation config.
    engine: an engine to reuse (e.g. across the checkpoints of a study): the model's weights are
      loaded into it and it is left open. Default: ``cfg.engine`` builds one, closed at the end.

  Raises:
    preemption.Stopped: a SIGTERM / SIGUSR1 arrived: the evaluation stopped after the slice of
      ``save_every`` problems in progress, their rows saved; a rerun resumes from there.
    OutputLockedError: another evaluation holds ``output_dir``.
    IdentityMismatchError: a benchmark's results come from another model or settings and
      ``overwrite`` is off.
  """
  out_dir = paths.as_path(cfg.output_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  with preemption.watch(), OutputLock(out_dir / ".lock", f"the evaluation {out_dir}"):
    return _run_evaluation(cfg, engine, out_dir)


def _run_evaluation(cfg: EvalConfig, engine: Any, out_dir: Path) -> EvalResult:
  """`run_evaluation` once the output directory is locked."""

  import_reward_plugins(cfg.reward_plugins)
  model_path, choice = resolve_model(cfg)
  tokenizer = load_tokenizer(model_path)
  scorers = _Scorers(cfg, model_path, int(tokenizer.pad_token_id if tokenizer.pad_token_id
                                          is not None else tokenizer.eos_token_id))
  todo = _claim_benchmarks(cfg, model_path, out_dir)
  results: dict[str, BenchmarkEval] = {}
  own = engine is None
  try:
    for name, path in cfg.benchmarks.items():
      if not path:
        continue
      if name not in todo:
        results[name] = BenchmarkEval.load(out_dir, name)
        continue
      if engine is None:
        if preemption.agreed():  # (before an engine starts: nothing of this benchmark is done)
          raise preemption.Stopped(f"evaluate: preempted ({preemption.requested()}) before "
                                   f"benchmark {name!r}; rerun the command to resume")
        engine = cfg.engine.make(model_path)
      elif not own and name == next(iter(todo)):
        engine.update_weights(models.to_hf_state_dict(models.from_pretrained(model_path)))
      results[name] = _evaluate_one(cfg, name, path, model_path, engine, tokenizer, scorers,
                                    out_dir)
  finally:
    if own and engine is not None:
      engine.close()
  return _write_summary(cfg, model_path, choice, results, sorted(todo), out_dir)


def _write_summary(cfg: EvalConfig, model_path: str, choice: selection.Choice | None,
                   results: dict[str, BenchmarkEval], evaluated_now: list[str], out_dir: Path
                   ) -> EvalResult:
  """The suite tables (summary.md / summary.json), with the run checkpoint taken and why."""
  tables: dict[str, dict[str, float]] = {}
  for name, out in results.items():
    if out.ability != "code":
      tables.setdefault(f"mean@{out.k}", {})[name] = out.metrics[f"mean@{out.k}"]
    else:
      tables.setdefault("pass@1", {})[name] = out.metrics["pass@1"]
      tables.setdefault(f"pass@{out.k}", {})[name] = out.metrics[f"pass@{out.k}"]
  result = EvalResult(output_dir=out_dir, method=cfg.method, model_path=model_path,
                      checkpoint=choice,
                      tables={m: metrics.results_json({cfg.method: v})[cfg.method]
                              for m, v in tables.items()},
                      evaluated_now=tuple(evaluated_now), benchmarks=results)
  summary = result.to_json()
  md = [f"# {cfg.method}: evaluation\n"]
  if choice is not None:
    md.append(f"Checkpoint: step {choice.step} of {cfg.run_dir}: {choice.reason}.\n")
  for metric, vals in tables.items():
    md.append(f"## {metric}\n\n" + metrics.markdown_table({cfg.method: vals}))
  if summary["diversity"]:
    md.append("## diversity\n\n```\n" + json.dumps(summary["diversity"], indent=1) + "\n```\n")
  if summary["exact"]:
    md.append("## exact target\n\n```\n" + json.dumps(summary["exact"], indent=1) + "\n```\n")
  (out_dir / "summary.md").write_text("\n".join(md))
  result.save()
  return result
