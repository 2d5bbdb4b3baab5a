"""The sigma_g study: it runs, its table has the right shape, and on a problem where the Jensen bias
dominates the anchor's error, the bias-corrected labels give a smaller error than plain labels.

Problem: P = 150 prompts with a 1-D embedding e, log Z(e) = 1 + sin(2e) (smooth, so the regressor can
average the per-prompt label noise away) and i.i.d. weights w = Z u with log u ~ N(-s^2/2, s^2), so
E[w] = Z exactly and CV^2 = e^{s^2} - 1 = 1.7: at small N the logsumexp label is biased down by about
CV^2 / (2N), a bias that averaging over prompts cannot remove.
"""
import dataclasses

import numpy as np
import pytest

from disa_jax import estimators as E
from disa_jax.anchor import AnchorFitConfig
from disa_jax.pipeline.anchor_study import (SigmaStudy, StudyRow, fold_masks, format_sigma_table,
                                            sigma_g_study, sigma_verdict,
                                            subsample_pool)

P, POOL, S = 150, 16, 1.0
FIT = AnchorFitConfig(hidden_sizes=(16,), batch_size=256, epochs=200, learning_rate=1e-2, val_fraction=0.0)


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  emb = rng.uniform(-1.5, 1.5, size=(P, 1)).astype(np.float32)
  log_z = 1.0 + np.sin(2.0 * emb[:, 0])
  log_w = log_z[:, None] + rng.normal(-S ** 2 / 2, S, size=(P, POOL))  # [P, POOL]
  data = E.Stage1Data(prompt_ids=[f"q{i}" for i in range(P)], prompts=[""] * P,
                      logp_ref=log_w.astype(np.float32), logp_proposal=np.zeros((P, POOL), np.float32),
                      reward=np.zeros((P, POOL), np.float32), num_tokens=np.ones((P, POOL), np.int32),
                      mask=np.ones((P, POOL), bool), stats={}, beta=1.0, reward_transform=E.RewardTransform(kind="raw"),
                      label_scale="sum", proposal_logprobs="raw", records=[])
  return emb, data, log_z


@pytest.fixture(scope="module")
def study():
  emb, data, log_z = _problem()
  return sigma_g_study(emb, data, log_z, ns=(2, 4), folds=3, repeats=2, fit=FIT, seed=0)


def test_result_and_table_shape(study):
  assert study.ns == (2, 4) and len(study.rows) == 3 * 2
  for row in study.rows:
    assert np.asarray(row.sigma_g).shape == (2, 2)  # [len(ns), repeats]
    for k in ("sigma_g_mean", "sigma_g_std", "label_rmse_mean", "label_rmse_std", "label_bias_mean"):
      v = getattr(row, k)
      assert len(v) == 2 and np.all(np.isfinite(v)), k
  table = format_sigma_table(study)
  lines = [ln for ln in table.splitlines() if ln.startswith("|")]
  assert lines[0] == "| variant | weighting | loss | N = 2 | N = 4 |"
  sigma_rows = lines[2:2 + 6]
  assert all(len(ln.strip("|").split("|")) == 3 + 2 and "±" in ln for ln in sigma_rows)
  assert lines[8].startswith("| label |") and len(lines) == 2 + 6 + 2 + 3  # + the 3-row label table


def test_bias_corrected_labels_beat_plain_where_bias_dominates(study):
  rows = {(r.variant, r.weighting): r for r in study.rows}
  plain = rows[("plain", "uniform")]
  for i, n in enumerate(study.ns):
    cv2 = np.exp(S ** 2) - 1
    assert -1.5 * cv2 / (2 * n) < plain.label_bias_mean[i] < -0.5 * cv2 / (2 * n)  # Prop. 1's bias
    # the sample CV^2 of N draws is at most N - 1, so the Jensen correction removes only part of the bias
    # at N = 2; the jackknife needs no CV^2 estimate
    for v, shrink in (("jensen", 0.9), ("jackknife", 0.6)):
      assert abs(rows[(v, "uniform")].label_bias_mean[i]) < shrink * abs(plain.label_bias_mean[i]), (v, n)
      # the regressor averages the noise, not the bias: the corrected labels give a smaller sigma_g
      assert rows[(v, "uniform")].sigma_g_mean[i] < plain.sigma_g_mean[i], (v, n)
    assert plain.sigma_g_mean[i] < plain.label_rmse_mean[i]  # the regressor smooths the noise
  verdict = sigma_verdict(study)
  assert [o.verdict for o in verdict.verdicts["jensen/uniform/squared"]] == ["better", "better"]


def test_study_is_seeded():
  emb, data, log_z = _problem(1)
  kw = dict(ns=(2,), folds=2, repeats=1, variants=("plain",), weightings=("uniform",),
            fit=AnchorFitConfig(hidden_sizes=(4,), batch_size=256, epochs=5, val_fraction=0.2), seed=3)
  a, b = sigma_g_study(emb, data, log_z, **kw), sigma_g_study(emb, data, log_z, **kw)
  assert a.rows == b.rows


def test_fold_masks_and_subsample():
  rng = np.random.default_rng(0)
  held = fold_masks(11, 3, rng)
  assert held.shape == (3, 11) and np.all(held.sum(0) == 1) and sorted(held.sum(1)) == [3, 4, 4]
  log_w = np.arange(12, dtype=np.float32).reshape(2, 6)
  mask = np.array([[1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0]], bool)
  sub, sub_mask = subsample_pool(log_w, mask, 3, rng)
  assert sub_mask.all() and len(set(sub[0])) == 3 and set(sub[1]) == {6.0, 8.0, 10.0}
  sub, sub_mask = subsample_pool(log_w[1:], mask[1:], 5, rng)  # more than the valid samples: all valid kept
  assert sub_mask.sum() == 3 and set(sub[sub_mask]) == {6.0, 8.0, 10.0}


def test_verdict_words():
  def row(v, sig):
    none = (float("nan"),) * 2
    return StudyRow(variant=v, weighting="uniform", loss="squared", huber_delta=0.0, sigma_g=sig,
                    sigma_g_mean=tuple(np.mean(sig, 1).tolist()), sigma_g_std=none,
                    label_rmse_mean=none, label_rmse_std=none, label_bias_mean=none)
  result = SigmaStudy(ns=(2, 8), folds=2, repeats=2, seed=0, floor=0.0, fit=FIT,
                      rows=(row("plain", ((1.0, 1.2), (0.5, 0.5))),
                            row("jensen", ((0.8, 1.0), (0.5, 0.51))),
                            row("jackknife", ((1.3, 1.4), (0.6, 0.4)))),
                      constant_sigma_g_mean=(1.0, 1.0), exact_std=1.0, pool_label_rmse=1.0,
                      pool_size=8, seconds=0.0)
  v = sigma_verdict(result)
  assert [o.verdict for o in v.verdicts["jensen/uniform/squared"]] == ["better", "no clear difference"]
  assert [o.verdict for o in v.verdicts["jackknife/uniform/squared"]] == ["worse", "no clear difference"]
  assert "jensen/uniform/squared" in v.text and v.best[0].row == "jensen/uniform/squared"
  result = dataclasses.replace(result, rows=(result.rows[0], result.rows[2]))
  assert "No variant beats plain least squares" in sigma_verdict(result).text


def test_bad_inputs():
  emb, data, log_z = _problem()
  with pytest.raises(ValueError, match="ns must be in"):
    sigma_g_study(emb, data, log_z, ns=(32,), fit=FIT)
  with pytest.raises(ValueError, match="embeddings must be"):
    sigma_g_study(emb[:10], data, log_z, fit=FIT)
  with pytest.raises(ValueError, match="variant='median'"):
    sigma_g_study(emb, data, log_z, variants=("median",), fit=FIT)
  with pytest.raises(ValueError, match="folds"):
    sigma_g_study(emb, data, log_z, folds=1, fit=FIT)
