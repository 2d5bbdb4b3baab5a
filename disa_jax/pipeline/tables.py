"""The claims tables of the main job, rendered from its report.json (the only source of the numbers
that README / docs print about the claims).

    python -m disa_jax.pipeline.tables /tmp/disa_claims/report.json           # print the tables
    python -m disa_jax.pipeline.tables report.json --check docs/real_checkpoints.md

Two tables: the methods at the end of training (mean ± std over Stage 3 seeds; a single run's KL
± its Monte Carlo standard error) with each method's end-state verdict, and the claims with their
verdicts, tests, raw and Holm-adjusted p-values and end-state flags (`pipeline.claims`); with
several Stage 1/2 data seeds, their anchors' errors; with a grid section, the regime and sigma_g
tables. A report from before issue 44 (no ``instrument`` section: KL by Monte Carlo, end states by
the slope test, no correction) is rendered in its own format, unchanged, except that a claim it
could not test reads "undecided" rather than "does NOT hold". A
document embeds the output between ``<!-- tables: PATH -->`` and ``<!-- /tables -->``; `check_document` (and
``--check``, and the tests) compare every such block with the generator's output for its PATH.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from disa_jax import codec
from disa_jax.pipeline.report_records import (Claim, FigureSummary, Grid, Instrument, Regime, Row,
                                              RunConfig)

BLOCK = re.compile(r"<!-- tables: (\S+) -->\n(.*?)<!-- /tables -->", re.S)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tables:
  """What the tables read of a report.json (`read`; the report's sections of the same names, each
  absent one empty: a table needs only its own). ``instrument`` None: a report from before issue
  44, rendered in its own format."""
  config: RunConfig | None = None
  instrument: Instrument | None = None
  regime: Regime = Regime(per_method={})
  methods: Mapping[str, Row] = codec.field(default_factory=dict)
  skipped_methods: Mapping[str, str] = codec.field(default_factory=dict)
  claims: tuple[Claim, ...] = ()
  stage3_seeds: tuple[int, ...] = ()
  run_seeds: Mapping[str, tuple[int, ...]] = codec.field(default_factory=dict)
  stage12_replicas: Mapping[str, Mapping[str, float]] = codec.field(default_factory=dict)
  grid: Grid | None = None

  @property
  def current(self) -> bool:
    """The report is from issue 44's instrument on (it has the ``instrument`` section)."""
    return self.instrument is not None


def read(report: Mapping[str, Any], path: str | Path = "report.json") -> Tables:
  """The tables' sections of ``report`` (report.json's contents, read from ``path``)."""
  return codec.decode(Tables, report, path)


def _kl_cols(report: Tables) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """(the KL columns' headers, their row keys): the primary KL and the Monte Carlo one beside it;
  an older report's Monte Carlo KL alone."""
  if report.current:
    return ("KL(pi ‖ pi~), decomposed", "KL, Monte Carlo"), ("kl_decomposed", "kl_to_target")
  return ("KL(pi ‖ pi~)",), ("kl_to_target",)


def _pm(row: Row, key: str, fmt: str, mc: str = " (MC)") -> str:
  """'value ± std' over seeds; a single run's 'value ± se<mc>' (its Monte Carlo error) where the
  row has one; else the value."""
  if f"{key}_std" in row:
    return f"{row[key]:{fmt}} ± {row[f'{key}_std']:{fmt}}"
  if f"{key}_se" in row:
    return f"{row[key]:{fmt}} ± {row[f'{key}_se']:{fmt}}{mc}"
  return f"{row[key]:{fmt}}"


def methods_table(report: Tables, *, every_row: bool = False) -> list[str]:
  """The methods at the end of training, from report.json's ``methods`` and ``regime``.

  Args:
    report: report.json's sections (`read`).
    every_row: report.md's table: every row (the reference, proposal and SFT rows too, and the rows
      not trained: ``skipped_methods``), the sampled metrics and the terms of the KL
      decomposition, a method's seeds in its label. Else the docs' table: the Stage 3 methods,
      their seeds, end state, P(correct), entropy over correct and KL.
  """
  states, rows = report.regime.per_method, report.methods
  kl_heads, kl_keys = _kl_cols(report)
  if every_row:
    k = next(iter(rows.values()))["k"] if rows else 8
    heads = ["method", "state", f"Mean@{k}", f"distinct correct in {k}", "P(correct)",
             "entropy over correct (target)", *kl_heads, "KL binary", "P_c KL_c", "P_w KL_w"]
  else:
    heads = ["method", "seeds", "end state", "P(correct)", "entropy over correct (target)",
             *kl_heads]
  md = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
  for name, row in rows.items():
    if not every_row and name not in states:  # (the reference / proposal / SFT rows)
      continue
    entropy = f"{_pm(row, 'entropy_correct', '.2f')} ({row['target_entropy_correct']:.2f})"
    kls = [_pm(row, key, ".3f", mc="" if every_row else " (MC)") for key in kl_keys]
    if every_row:
      label = f"{name} ({row['seeds']} seeds)" if "seeds" in row else name
      cells = [label, states.get(name, "-"), _pm(row, "accuracy_mean_at_k", ".3f"),
               _pm(row, "distinct_correct_mean", ".2f"), _pm(row, "p_correct_exact", ".3f"),
               entropy, *kls, *(_pm(row, key, ".3f") for key in
                                ("kl_binary", "p_correct_kl_correct", "p_wrong_kl_wrong"))]
    else:
      cells = [f"`{name}`", str(row.get("seeds", 1)), states[name],
               _pm(row, "p_correct_exact", ".3f"), entropy, *kls]
    md.append("| " + " | ".join(cells) + " |")
  if every_row:
    md += [f"| {name} | not trained: {why} | | | | | | | | | |"
           for name, why in report.skipped_methods.items()]
  return md


def _stats(n: Mapping[str, Any]) -> str:
  """A legacy claim's Welch test from its ``numbers`` (as report.json stores them)."""
  if "p" not in n:
    return "-"
  return (f"diff {n['diff']:+.3f}, 95% CI [{n['ci95'][0]:+.3f}, {n['ci95'][1]:+.3f}], "
          f"p = {n['p']:.3g} (seeds {n['seeds'][0]} / {n['seeds'][1]})")


_STATES = {"end state": "end state", "transient": "TRANSIENT", "undecided": "end state undecided",
           "-": "-"}


def claims_table(report: Tables) -> list[str]:
  """Each claim: its verdict, the end state of the runs it compares, its test, its raw and
  Holm-adjusted p-values (`pipeline.claims`); an older report's claims in its own format."""
  if not report.current:
    return _legacy_claims_table(report)
  md = ["| claim | verdict | state | test | p | p (Holm) | why not |", "|---|---|---|---|---|---|---|"]
  for c in report.claims:
    t = c.test
    p = lambda v: "-" if v is None else f"{v:.3g}"
    md.append(f"| {c.claim} | {c.verdict} | {_STATES[c.state]} | "
              f"{'-' if t is None else t.summary} | {p(t and t.p)} | {p(t and t.p_holm)} | "
              f"{c.why if c.verdict != 'holds' else ''} |")
  return md


def _legacy_claims_table(report: Tables) -> list[str]:
  """The claims of a report from before issue 44: Welch over seeds, uncorrected; a claim with
  no test (no p-value) that does not hold reads "undecided"."""
  md = ["| claim | verdict | state | Welch over seeds | why not |", "|---|---|---|---|---|"]
  for c in report.claims:
    verdict = ("holds" if c.holds else "does NOT hold" if "p" in c.numbers or not c.why
               else "undecided")
    state = "TRANSIENT" if c.from_transient else "end state" if c.runs else "-"
    md.append(f"| {c.claim} | {verdict} | {state} | {_stats(c.numbers)} | {c.why or ''} |")
  return md


def _fig(s: FigureSummary, fmt: str) -> str:
  """A figure's `grid.summary`: 'mean ± std [lo, hi]' (one seed: the value)."""
  if s.n == 0:
    return "-"
  if s.ci95 is None:
    return f"{s.mean:{fmt}}"
  return f"{s.mean:{fmt}} ± {s.std:{fmt}} [{s.ci95[0]:{fmt}}, {s.ci95[1]:{fmt}}]"


def regime_table(report: Tables) -> list[str]:
  """Per Stage 3 method of the grid section: its regime, seeds, end state, final KL, conditional KL
  over correct answers, steps to P(correct) >= 0.9 and gradient noise (`pipeline.grid`)."""
  grid, states = report.grid, report.regime.per_method
  heads = _kl_cols(report)[0]
  kls = ("kl", "kl_mc") if report.current else ("kl",)
  md = ["| run | regime | seeds | end state | " + " | ".join(heads) + " | KL(pi\\|c ‖ pi~\\|c) | "
        "steps to P(c) 0.9 (reached) | gradient noise E\\|g\\|² | median \\|g\\|² |",
        "|---|---|---|---|---|---|---|---|" + "---|" * len(heads)]
  for m, f in grid.figures.items():
    md.append(f"| `{m}` | {grid.regimes[m]} | {f.seeds} | {states.get(m, '-')} | "
              + "".join(f"{_fig(f.figure(k), '.3f')} | " for k in kls)
              + f"{_fig(f.kl_correct, '.3f')} | "
              f"{_fig(f.steps_to_level, '.0f')} ({f.reached}/{f.seeds}) | "
              f"{_fig(f.grad_sq, '.3g')} | {_fig(f.grad_sq_median, '.3g')} |")
  return md


def sigma_table(report: Tables) -> list[str]:
  """Per regime with an exact-log-Z run: sigma_g, KL and the loss gap against Prop. 4's envelope."""
  md = [f"| regime | run | sigma_g | seeds | {_kl_cols(report)[0][0]} | loss gap to exact (first "
        "seeds) | envelope |", "|---|---|---|---|---|---|---|"]
  for regime, pts in report.grid.sigma_curve.items():
    for p in pts:
      kl = f"{p.kl:.3f}" + (f" ± {p.kl_std:.3f}" if p.seeds > 1 else "")
      md.append(f"| {regime} | `{p.run}` | {p.sigma:.3g} | {p.seeds} | {kl} | "
                f"{p.loss_gap:.3g} | {p.envelope:.3g} |")
  return md


def replicas_table(report: Tables) -> list[str]:
  """Per Stage 1/2 data seed (`RunSpec.data_seed`): the labels' error and the anchor's sigma_g
  against the exact log Z ('-' on the mean scale, where there is no exact value), the fit's
  validation MSE against its labels and its best epoch."""
  md = ["| Stage 1/2 data seed | label mean abs error vs exact | sigma_g held-out | sigma_g all | "
        "val MSE vs labels | best epoch |", "|---|---|---|---|---|---|"]
  cell = lambda r, k: f"{r[k]:.4f}" if k in r else "-"
  for d, r in report.stage12_replicas.items():
    md.append(f"| {d} | {cell(r, 'label_mae_vs_exact')} | {cell(r, 'sigma_g_heldout')} | "
              f"{cell(r, 'sigma_g_all')} | {cell(r, 'val_mse_vs_labels')} | {r['best_epoch']} |")
  return md


def render(report: Mapping[str, Any], path: str | Path = "report.json") -> str:
  """The tables of report.json's contents ``report`` (read from ``path``), with the run they come
  from: methods and claims; with a grid section (reports since issue 27) the regime table, and
  the sigma_g table when the grid has an exact-log-Z run."""
  tab = read(report, path)
  cfg = tab.config
  own = any(list(s) != list(tab.stage3_seeds) for s in tab.run_seeds.values())
  seeds = "per run (the seeds column)" if own else str(list(tab.stage3_seeds))
  head = (f"Preset `{cfg.preset}`, {cfg.stage3_steps} Stage 3 steps, Stage 3 seeds "
          f"{seeds}, beta = {cfg.beta:g}, task {cfg.task}.")
  if tab.current:
    tested = sum(1 for c in tab.claims if c.test)
    head += (f" Every verdict uses KL = `{tab.instrument.primary_metric}`; p-values "
             f"Holm-adjusted over the report's {tested} tests.")
  parts = [head, "", *methods_table(tab), "", *claims_table(tab)]
  if tab.stage12_replicas:
    parts += ["", *replicas_table(tab)]
  if tab.grid is not None:
    parts += ["", *regime_table(tab)]
    if tab.grid.sigma_curve:
      parts += ["", *sigma_table(tab)]
  return "\n".join(parts) + "\n"


def check_document(path: str | Path, root: str | Path = ".") -> int:
  """Raises if a ``<!-- tables: PATH -->`` block of ``path`` differs from `render` of PATH
  (relative to ``root``); returns the number of blocks checked."""
  text = Path(path).read_text()
  blocks = BLOCK.findall(text)
  for report_path, body in blocks:
    want = render(json.loads((Path(root) / report_path).read_text()), report_path)
    if body != want:
      raise ValueError(f"{path}: the tables block of {report_path} is not the generator's output; "
                       f"regenerate it with `python -m disa_jax.pipeline.tables {report_path}`")
  return len(blocks)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("report", help="a main-job report.json")
  parser.add_argument("--check", metavar="DOC", help="compare DOC's tables blocks instead")
  args = parser.parse_args(argv)
  if args.check:
    print(f"{args.check}: {check_document(args.check)} tables block(s) match")
    return 0
  sys.stdout.write(render(json.loads(Path(args.report).read_text()), args.report))
  return 0


if __name__ == "__main__":
  sys.exit(main())
