"""The primary KL's noise: the wrong-answer term from the plain samples against its own conditional
samples (`ExactTargetConfig.wrong_samples`, `disa_jax.eval.wrong_answers`), on trained policies.

For each run of a finished main-job workdir (``<workdir>/stage3/<run>/final``, the job's pi_ref,
prompts and tracking settings), the exact tracker measures the same policy ``--reps`` times, each
time with fresh samples (steps 1..reps), once per setting of ``--wrong-samples`` (0 = the plain
estimator over the ``--kl-samples`` samples), the settings alternating within each rep. Per run and
setting: the mean of ``kl_decomposed`` with its standard error over reps, the SD over reps (the
noise of one measurement), the root-mean-square of the measurements' own standard errors (does the
reported SE match that SD?), the share of measurements with a reported SE of 0, and the seconds per
measurement (median, min-max); the ratio of each SD and time to the first setting's; the load
average before and after. A setting is a number of conditional samples, whether the scorers
share each prompt's tokens across its sequences (``--share-prompts 0,1``,
`ExactTargetConfig.share_prompts`) and how the conditional samples are decoded
(``--wrong-decode full,cached``, `ExactTargetConfig.wrong_decode`) and how many packed rows its
scorers run per pass (``--scorer-rows 64,8``, `ExactTargetConfig.scorer_rows`): every combination
of the four lists. For each setting, the largest difference of ``kl_decomposed`` from the first
setting of the same wrong_samples at the same step (their samples are drawn from the same seeds).

    python benchmarks/bench_wrong_term.py --workdir /tmp/pilot \\
        --runs disa_pos_replay,disa,disa_exact_seed1,grpo [--reps 40] [--wrong-samples 0,32] \\
        [--share-prompts 0] [--wrong-decode full] [--scorer-rows 64] [--kl-samples 32] \\
        [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from disa_jax import runtime, tasks
from disa_jax.data.prompting import encode_prompt
from disa_jax.data.tokenizer import load_tokenizer
from disa_jax.eval.exact import ExactTargetConfig
from disa_jax.rollout.engines import make_engine
from disa_jax.tasks.prompts import load_prompts


def _run(workdir: Path, run: str, args) -> dict:
  """Every setting's measurements of one run's exported policy."""
  config = json.loads((workdir / "stage3" / run / "config.json").read_text())
  ref_path, policy_path = config["exact_target"]["reference_path"], str(workdir / "stage3" / run /
                                                                         "final")
  tok = load_tokenizer(ref_path)
  records = load_prompts(config["data"]["train_path"], "auto")
  rollout = config["train"]["rollout"]
  cfgs = {setting(k, s, d, r): ExactTargetConfig(
      reference_path=ref_path, beta=config["exact_target"]["beta"], kl_samples=args.kl_samples,
      wrong_samples=k, seed=args.seed, share_prompts=bool(s), wrong_decode=d, scorer_rows=r)
          for k in args.wrong_samples for s in args.share_prompts for d in args.wrong_decode
          for r in args.scorer_rows}
  first = next(iter(cfgs.values()))
  ref_model, policy_model = first.load_model(ref_path), first.load_model(policy_path)
  scorers = {k: (c.scorer(ref_model, tok.pad_token_id), c.scorer(policy_model, tok.pad_token_id))
             for k, c in cfgs.items()}
  prompts = [encode_prompt(tok, r, config["data"]["rendering"], max_len=rollout["max_prompt_len"])
             for r in records]
  trackers = {k: tasks.get_task(records[0].ability).measures(
      c, tok, prompts, [r.reward_meta() for r in records], lambda k=k: scorers[k][0],
      max_tokens=rollout["max_response_len"]) for k, c in cfgs.items()}
  engine = make_engine("jax", policy_path, options={"max_batch_size": 64, "dtype": "float32"},
                       process=None)
  got = {k: {"kl": [], "se": [], "s": []} for k in cfgs}
  try:
    for k, tracker in trackers.items():  # compile every setting's programs before timing
      tracker.measure(engine, scorers[k][1], step=10 ** 6)
    for rep in range(args.reps):
      for k, tracker in trackers.items():
        t0 = time.perf_counter()
        m = tracker.measure(engine, scorers[k][1], step=rep + 1)
        got[k]["s"].append(time.perf_counter() - t0)
        got[k]["kl"].append(m["kl_decomposed"])
        got[k]["se"].append(m["kl_decomposed_se"])
  finally:
    engine.close()
  return got


def setting(wrong_samples: int, share_prompts: int, wrong_decode: str, scorer_rows: int = 64
            ) -> str:
  """A setting's name in the results: 'w<wrong_samples>', with '_s1' appended where the scorers
  share prompts, '_cached' where the wrong samples decode through a KV cache and '_r<rows>' where
  the scorers run other than 64 rows per pass."""
  return (f"w{wrong_samples}" + ("_s1" if share_prompts else "")
          + ("" if wrong_decode == "full" else f"_{wrong_decode}")
          + ("" if scorer_rows == 64 else f"_r{scorer_rows}"))


def _summary(got: dict, base: str) -> dict:
  out = {}
  for k, g in got.items():
    kl, se, s = (np.asarray(g[x], np.float64) for x in ("kl", "se", "s"))
    out[k] = {"mean": float(kl.mean()), "mean_se": float(kl.std(ddof=1) / np.sqrt(kl.size)),
              "sd": float(kl.std(ddof=1)), "rms_reported_se": float(np.sqrt(np.mean(se ** 2))),
              "share_se_zero": float(np.mean(se == 0)), "s_median": float(np.median(s)),
              "s_min": float(s.min()), "s_max": float(s.max())}
  for k in out:
    out[k]["sd_ratio"] = out[k]["sd"] / out[base]["sd"]
    out[k]["time_ratio"] = out[k]["s_median"] / out[base]["s_median"]
    # the first setting of the same wrong_samples: its draws come from the same seeds
    same = next(j for j in got if j.split("_")[0] == k.split("_")[0])
    if k != same:
      out[k]["max_abs_diff_vs_" + same] = float(np.max(np.abs(
          np.asarray(got[k]["kl"]) - np.asarray(got[same]["kl"]))))
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--runs", required=True, help="comma-separated stage3 run directories")
  p.add_argument("--reps", type=int, default=40)
  p.add_argument("--wrong-samples", default="0,32")
  p.add_argument("--share-prompts", default="0", help="0, 1 or 0,1 (ExactTargetConfig)")
  p.add_argument("--wrong-decode", default="full", help="full, cached or full,cached")
  p.add_argument("--scorer-rows", default="64", help="e.g. 64,8 (ExactTargetConfig)")
  p.add_argument("--kl-samples", type=int, default=32)
  p.add_argument("--seed", type=int, default=1000)
  p.add_argument("--json", default="")
  args = p.parse_args()
  args.wrong_samples = [int(x) for x in args.wrong_samples.split(",")]
  args.share_prompts = [int(x) for x in args.share_prompts.split(",")]
  args.wrong_decode = args.wrong_decode.split(",")
  args.scorer_rows = [int(x) for x in args.scorer_rows.split(",")]
  report = {"machine": runtime.host_description(), "load_before": runtime.load_average(),
            "runs": {}, "args": vars(args)}
  for run in args.runs.split(","):
    report["runs"][run] = _summary(_run(Path(args.workdir), run, args),
                                   setting(args.wrong_samples[0], args.share_prompts[0],
                                           args.wrong_decode[0], args.scorer_rows[0]))
    for k, r in report["runs"][run].items():
      diff = "".join(f" | {n} {v:.2e}" for n, v in r.items() if n.startswith("max_abs_diff"))
      print(f"{run:24s} {k:8s} kl_decomposed {r['mean']:.4f} +- {r['mean_se']:.4f} "
            f"| SD/measure {r['sd']:.4f} (x{r['sd_ratio']:.3f}) | rms reported SE "
            f"{r['rms_reported_se']:.4f}, SE = 0 in {r['share_se_zero']:.0%} | "
            f"{r['s_median']:.2f} s [{r['s_min']:.2f}, {r['s_max']:.2f}] (x{r['time_ratio']:.2f})"
            f"{diff}")
  report["load_after"] = runtime.load_average()
  print(f"load average: before {report['load_before']}, after {report['load_after']}")
  if args.json:
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
  main()
