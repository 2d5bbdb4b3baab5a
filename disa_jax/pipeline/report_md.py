"""report.md (`report_md`), drawn from report.json's own sections (`pipeline.report`): the methods
table, the regime grid, the conditional KLs, matched accuracy, the endpoints, the claims, the
anchor gap, Stages 1-2 and their replicates, the N-study and the time per stage."""
from __future__ import annotations

from typing import Any, Mapping

from disa_jax import codec
from disa_jax.pipeline import endpoints, step_size, tables
from disa_jax.pipeline.anchor_study import SigmaStudy, format_sigma_table
from disa_jax.pipeline.provenance import Provenance
from disa_jax.pipeline.report_records import MatchedSummary
from disa_jax.pipeline.sum_models import TinyLMSpec


def report_md(report: Mapping[str, Any], arch: TinyLMSpec) -> list[str]:
  """report.md's lines from the report's sections (``arch``: the tiny models', named in the
  header)."""
  cfg = report["config"]
  return [f"# DISA main job: sum task, {cfg['task']}, beta = {cfg['beta']}", "",
          f"Preset {cfg['preset']!r}, {cfg['stage3_steps']} Stage 3 steps per run. Engine: "
          f"{cfg['engine']}. Models: tiny Qwen3 ({arch.num_layers} layers, d = "
          f"{arch.hidden_size}), {models_origin(_provenance(report))}.", "",
          *methods_md(tables.read(report)), *grid_md(report),
          *conditional_kl_md(report.get("conditional_kl")),
          *matched_md({m: {lvl: codec.decode(MatchedSummary, row, "report.json",
                                             f"matched_accuracy.{m}.{lvl}")
                           for lvl, row in levels.items()}
                       for m, levels in report["matched_accuracy"].items()}),
          *(endpoints.markdown(codec.decode(endpoints.EndpointsSection, report["endpoints"],
                                            "report.json", "endpoints"))
            if "endpoints" in report else []),
          *(step_size.step_size_markdown(codec.decode(step_size.StepSizeSection,
                                                      report["step_size"], "report.json",
                                                      "step_size"))
            if "step_size" in report else []),
          *claims_md(report), *anchor_gap_md(report["anchor_gap"]),
          *stage12_md(report["stage1"], report["stage2"], report["anchor_study"]),
          *replicas_md(report["stage12_replicas"]), *nstudy_md(report["nstudy"]),
          *times_md(report["times_s"]), "", "Plots: " + ", ".join(report["plots"])]


def replicas_md(section: Mapping[str, Mapping[str, float]]) -> list[str]:
  if not section:
    return []
  return ["## Stage 1/2 data seeds", "",
          "Stage 1 drawn again (sampling seed + d) and Stage 2 fitted on it (fit seed + d); the runs "
          "named `*_data<d>` read that anchor and replay pool.", "",
          *tables.replicas_table(tables.Tables(stage12_replicas=section)), ""]


def anchor_study_md(section: dict | None) -> list[str]:
  """The sigma_g study of sharper anchors, from report.json's ``anchor_study`` (None: off)."""
  if section is None:  # the study is off (stage2.study_repeats = 0)
    return []
  res = codec.decode(SigmaStudy, section, "report.json", "anchor_study")
  return ["## Sharper anchors? sigma_g against the exact log Z (issue 9)", "",
          f"Held-out sigma_g = RMS(g(q) - log Z(q)), {res.folds}-fold cross-validation over prompts, "
          f"{res.repeats} repeats of the N-sample subsample per N (mean ± std over repeats). Defaults stay "
          "plain least squares unless a variant wins below.", "", format_sigma_table(res), "",
          res.verdict.text, ""]


def grid_md(report: dict) -> list[str]:
  """The regime table (`tables.regime_table`) and the KL-against-sigma_g rows."""
  md = ["## End-state figures per run (regime table)", "",
        "Mean ± std over the run's seeds [95% interval]; KL: the primary (decomposed) and the Monte "
        "Carlo one; steps to P(correct) = 0.9 (interpolated) over the seeds that got there; "
        "gradient noise = the mean squared gradient norm over the end-state window "
        f"(the last {report['instrument']['end_state']['window']:.0%} of steps; "
        "`disa_jax.pipeline.grid`).", "", *tables.regime_table(tables.read(report)), ""]
  if report["grid"]["sigma_curve"]:
    md += ["KL against the log Z error sigma_g (kl_vs_sigma.png), with the loss gap to the exact "
           "log Z run and Prop. 4's envelope sigma^2 + 2 sigma sqrt(L_TB):", "",
           *tables.sigma_table(tables.read(report)), ""]
  return md


def _provenance(report: Mapping[str, Any]) -> Provenance | None:
  section = report.get("provenance")
  return codec.decode(Provenance, section, "report.json") if section else None


def models_origin(prov: Provenance | None) -> str:
  """Where the job's models came from (report.json's ``provenance``): the pinned store entry, or
  trained on the named processor; a report from before provenance was recorded (None) says what
  every job did then."""
  if prov is None:
    return "trained here and reloaded from HF checkpoints"
  m = prov.models
  if m.source == "pinned":
    return (f"the pinned pi_ref and p_T of store entry {m.key} (disa_jax/pipeline/pinned_models, "
            "each file checked by sha256)")
  other = f"; the pin {m.key} holds others" if m.pinned_fingerprint not in ({}, m.fingerprint) else ""
  return f"trained on this machine ({prov.cpu}){other}"


def methods_md(report: tables.Tables) -> list[str]:
  """The end-state table (`tables.methods_table`, every row): sampled metrics, the exact target
  and the KL decomposition."""
  md = ["## Methods at the end of training", "",
        "Evaluation at temperature 1. KL(pi ‖ pi~), the primary KL every verdict uses: its exact "
        "decomposition KL(P_c ‖ P~_c) + P_c KL(pi|c ‖ pi~|c) + P_w KL(pi|w ‖ pi~|w) (only the last "
        "term is sampled); beside it the plain Monte Carlo KL with the exact log Z.", ""]
  seeds = report.stage3_seeds
  if len(seeds) > 1:
    md += [f"Stage 3 seeds {list(seeds)}: cells are mean ± std over seeds (a single run's "
           "KL: ± its Monte Carlo standard error). A run with seeds of its own (`RunSpec.seeds`) "
           "says how many in its label.", ""]
  return md + tables.methods_table(report, every_row=True) + [""]


def matched_md(matched: Mapping[str, Mapping[str, MatchedSummary]]) -> list[str]:
  """Entropy over correct and KL over correct at each accuracy level, interpolated (report.json's
  ``matched_accuracy``)."""
  if not matched:
    return []
  md = ["## At matched accuracy (interpolated to P(correct) = level)", "",
        "Mean ± std over the seeds interpolated between the measurements around the level; a seed "
        "already past the level at its first measurement has no match there ('already past').", "",
        "| method | level | seeds matched | already past | step | entropy over correct | "
        "KL(pi\\|c ‖ pi~\\|c) | KL(pi ‖ pi~), decomposed |", "|---|---|---|---|---|---|---|---|"]
  for m, levels in matched.items():
    for lvl, row in levels.items():
      got = f"{len(row.seeds_reached)} of {row.seeds} | {len(row.seeds_already_past)}"
      if not row.seeds_reached:
        md.append(f"| {m} | {lvl} | {got} | - | - | - | - |")
        continue
      f = lambda key, fmt: f"{getattr(row, key)[0]:{fmt}} ± {getattr(row, key)[1]:{fmt}}"
      md.append(f"| {m} | {lvl} | {got} | {f('step', '.0f')} | {f('entropy_correct', '.2f')} | "
                f"{f('kl_correct', '.3f')} | {f('kl', '.3f')} |")
  return md + [""]


def stage12_md(s1: dict, s2: dict, study: dict | None) -> list[str]:
  stats = (f"median ESS {s1['ess_median']:.2f}, median CV^2 {s1['cv2_median']:.3f}; proposal "
           f"accuracy {s1['proposal_accuracy']:.3f}; prompts with no correct sample: "
           f"{s1['prompts_without_correct_sample']}")
  fit = (f"- best epoch {s2['best_epoch']}, val MSE vs labels {s2['val_mse_vs_labels']:.4f}, val R^2 "
         f"vs labels {s2['val_r2_vs_labels']:.3f} ({s2['n_val']} held-out prompts)")
  if "n_study_mae_vs_exact" not in s1:  # labels on the mean scale: no exact value to compare with
    md = [f"## Stage 1 (labels on the {s1['label_scale']} scale: no exact value to compare with)", "",
          f"- N = {s1['n']}: {stats}", "", "| N | mean Var(log Z_N) |", "|---|---|"]
    md += [f"| {m} | {v:.4f} |" for m, v in s1["n_study_variance"].items()]
    return md + ["", "## Stage 2 (anchor)", "", fit, ""] + anchor_study_md(study)
  md = ["## Stage 1 (log Z_IS against the exact log Z)", "",
        f"- N = {s1['n']}: mean |log Z_IS - log Z| = {s1['label_mae_vs_exact']:.4f}, mean signed error "
        f"{s1['label_signed_error_mean']:+.4f}; {stats}",
        f"- exact log Z across prompts: mean {s1['log_z_exact_mean']:.3f}, std {s1['log_z_exact_std']:.3f}",
        "", "| N | mean abs error vs exact | mean Var(log Z_N) |", "|---|---|---|"]
  md += [f"| {m} | {v:.4f} | {s1['n_study_variance'][m]:.4f} |" for m, v in s1["n_study_mae_vs_exact"].items()]
  md += ["", "## Stage 2 (anchor)", "", fit,
         f"- sigma_g = RMS(g(q) - log Z(q)): held-out {s2['sigma_g_heldout']:.4f}, all prompts "
         f"{s2['sigma_g_all']:.4f} (the raw labels' RMS error on the held-out prompts: "
         f"{s2['label_rmse_heldout']:.4f})", *generalisation_md(s2.get("generalisation")), ""]
  return md + anchor_study_md(study)


def generalisation_md(gen: dict | None) -> list[str]:
  if gen is None:
    return []
  row = lambda name, g: (f"| {name} | {g['prompts']} | {g['log_z_std']:.3f} | {g['log_z_range']:.3f} "
                         f"| {g['r2']:.3f} | {g['sigma_g']:.4f} | {g['sigma_constant']:.4f} | "
                         f"{g['sigma_g_over_constant']:.3f} |")
  return ["", "The anchor on prompts it never saw (held out of Stages 2 and 3) against the exact "
          "log Z; the constant is the fit's mean label:", "",
          "| prompts | P | std log Z | range log Z | R^2 | sigma_g | sigma constant | "
          "sigma_g / constant |", "|---|---|---|---|---|---|---|---|",
          row("held out", gen["heldout"]), row("fitted", gen["fitted"])]


def nstudy_md(ns: dict | None) -> list[str]:
  """The App. C.3 command's statistics (`workflows.nstudy`): variance and bias of log Z_M vs M."""
  if ns is None:
    return []
  md = ["## The App. C.3 N-study (stratified subset, pool of "
        f"{ns['pool_size']}; `nstudy/`)", "",
        f"- {ns['prompts']} prompts ({ns['prompts_with_full_pool']} with a full pool), "
        f"{ns['repeats']} subsamples per prompt and M", "",
        "| M | mean Var(log Z_M) | mean abs(Z_M - Z_pool) / Z_pool |", "|---|---|---|"]
  md += [f"| {r['M']} | {r['variance_mean']:.4f} | {r['relative_bias_mean']:.4f} |"
         for r in ns["per_m"]]
  if "variance_reduction_2_to_8" in ns:
    md += ["", f"- variance reduction from M = 2 to M = 8: {100 * ns['variance_reduction_2_to_8']:.1f}% "
           "(the paper: about 75%)"]
  if "relative_bias_change_8_to_16" in ns:
    md += [f"- relative bias removed from M = 8 to M = 16: "
           f"{100 * ns['relative_bias_change_8_to_16']:.1f} points (the paper: about 3)"]
  return md + [""]


def anchor_gap_md(gap: dict | None) -> list[str]:
  if gap is None:
    return []
  share = ("" if "gap_over_envelope" not in gap else
           f" (the gap is {gap['gap_over_envelope']:.3g} of it)")
  check = (f"|L_DISA - L_TB| (training prompts) = {gap['loss_gap']:.4f} against the envelope with "
           f"the held-out sigma_g, {gap['envelope']:.4f}{share}: " + (
               gap["verdict"] if gap["verdict"] is not None else f"{gap['verdict_why']}"
               if gap["verdict_why"].startswith("no verdict") else
               f"no verdict ({gap['verdict_why']})"))
  return ["## The anchor's error: DISA against the oracle (Prop. 4)", "",
          f"- KL(pi ‖ pi~), decomposed: DISA (fitted anchor) {gap['kl_disa']:.3f}, disa_exact (exact log Z) "
          f"{gap['kl_disa_exact']:.3f}: gap {gap['kl_gap']:+.3f} nats",
          f"- at DISA's final policy, on the anchor's training prompts: sigma_g = "
          f"{gap['sigma_g_train']:.4f}, L_TB(exact log Z) = {gap['loss_tb']:.3f}, L_DISA = "
          f"{gap['loss_disa']:.3f}, |L_DISA - L_TB| = {gap['loss_gap']:.4f}; the same-sample "
          f"envelope sigma_g^2 + 2 sigma_g sqrt(L_TB) = {gap['envelope_same_sample']:.4f} "
          "(Cauchy-Schwarz on the same moments: it cannot be exceeded, so it is no evidence)",
          f"- held-out sigma_g = {gap['sigma_g_heldout']:.4f}; {check}", ""]


def claims_md(report: dict) -> list[str]:
  regime, ins = report["regime"], report["instrument"]
  e = ins["end_state"]
  rule = (f"a method is at its end state when the {e['level']:.0%} interval of the change of the "
          f"primary KL and of the conditional KL over correct answers across the last "
          f"{e['window']:.0%} of measured steps (>= {e['min_points']} measurements, pooled over its "
          f"seeds) lies inside +-max({e['delta_abs']:g}, {e['delta_rel']:g} x the value)"
          + ("" if "serial" not in e else
             f" (the value: the line's mean level over the window; serial correlation "
             f"'{e['serial']}')"))
  head = ("Every method reached its end state" if regime["all_at_end_state"] else
          f"Preset {regime['preset']!r}: not every method reached its end state (verdicts marked "
          "TRANSIENT or 'end state undecided' compare runs not shown to be at it)")
  return ["## The paper's claims on this task", "",
          f"{head}; {rule}. Every verdict uses the primary KL `{ins['primary_metric']}` (the exact "
          "decomposition; the Monte Carlo KL is shown beside it). A run whose entropy over correct "
          f"answers is below {ins['collapse_entropy_fraction']:g} of the target's collapsed, one "
          f"whose KL is above {ins['divergence_factor']:g} x the reference policy's diverged: "
          "failures are counted by Fisher's "
          "exact test and KL compared by Welch's test over the other runs. A claim holds only if "
          f"its p-value, Holm-adjusted over the report's tests, is < {ins['alpha']:g}; a claim "
          "that could not be tested is undecided.", "", *tables.claims_table(tables.read(report)), "",
          "Numbers of each claim: `claims` in report.json.", ""]


def conditional_kl_md(section: Mapping[str, Mapping[str, float]] | None) -> list[str]:
  """The table "Preference among correct answers": per row, the means of KL(pi|c ‖ pi~|c) and
  KL(pi|c ‖ p_T|c) over the training prompts (and over the held-out prompts, when there are any).

  Args:
    section: report.json's ``conditional_kl`` (`ConditionalKLs.report_section`); None: no table.
  """
  if section is None:
    return []
  held = any("kl_target_correct_mean_heldout" in e for e in section.values())
  cols = ["KL(pi\\|c ‖ pi~\\|c)", "KL(pi\\|c ‖ p_T\\|c)"]
  keys = ["kl_target_correct_mean", "kl_proposal_correct_mean"]
  if held:
    cols = [f"{c}, {where}" for where in ("training prompts", "held-out prompts") for c in cols]
    keys += [f"{k}_heldout" for k in keys]
  md = ["## Preference among correct answers", "",
        "Per model, the mean over prompts of KL(pi|c ‖ pi~|c) (against the target's preference "
        "among correct answers, pi~|c = pi_ref|c) and of KL(pi|c ‖ p_T|c) (against the proposal's); "
        "per prompt in conditional_kl.json.", "",
        "| model | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
  md += [f"| {row} | " + " | ".join(f"{e[k]:.4f}" if e.get(k) is not None else "-" for k in keys)
         + " |" for row, e in section.items()]
  return md + [""]


def times_md(times: Mapping[str, float]) -> list[str]:
  return ["## Time per stage (s)", "", ", ".join(f"{k} {v:.1f}" for k, v in times.items())]
