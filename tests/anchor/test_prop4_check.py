"""`prop4_check`: Prop. 4 with its sides estimated on disjoint prompts can fail; on the same prompts
it is Cauchy-Schwarz and cannot, so it is reported as a number, never a verdict."""
import numpy as np
import pytest

from disa_jax.anchor.diagnostics import prop4_check


def test_an_anchor_worse_on_its_training_prompts_than_held_out_violates_the_check():
  # residuals R with E[R] = 0.5, E[R^2] = 1 per prompt; the anchor is off by 1 nat on its training
  # prompts and by 0.1 on the held-out ones
  eta_train, r1, r2 = np.full(6, 1.0), np.full(6, 0.5), np.full(6, 1.0)
  c = prop4_check(eta_train, r1, r2, eta_heldout=np.full(3, 0.1))
  assert c.loss_tb == 1.0 and c.loss_disa == pytest.approx(1.0 + 2 * 0.5 + 1.0)
  assert c.loss_gap == pytest.approx(2.0) and c.envelope == pytest.approx(0.01 + 0.2)
  assert c.verdict == "violated"
  # the same-sample bound holds whatever the numbers (Cauchy-Schwarz): not evidence
  assert c.loss_gap <= c.envelope_same_sample == pytest.approx(1.0 + 2.0)


def test_a_held_out_error_like_the_training_one_holds_and_no_held_out_prompts_gives_no_verdict():
  rng = np.random.default_rng(0)
  eta, r1 = rng.normal(0, 0.3, 40), rng.normal(0.2, 0.1, 40)
  r2 = r1 ** 2 + 0.5
  c = prop4_check(eta, r1, r2, eta_heldout=rng.normal(0, 0.3, 10))
  assert c.verdict == "holds" and c.loss_gap <= c.envelope
  none = prop4_check(eta, r1, r2, eta_heldout=np.zeros(0))
  assert none.verdict is None and np.isnan(none.envelope) and np.isnan(none.sigma_g_heldout)


def test_mismatched_arrays_are_refused():
  with pytest.raises(ValueError, match="shapes \\(2,\\), \\(3,\\), \\(2,\\)"):
    prop4_check(np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(1))
