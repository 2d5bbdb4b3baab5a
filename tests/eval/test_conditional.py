"""`disa_jax.eval.conditional.conditional_kl` on analytic cases and against `eval.exact`."""
import math

import numpy as np
import pytest

from disa_jax.eval.conditional import conditional_kl
from disa_jax.eval.exact import correct_set_terms


def test_analytic_values():
  # p|C uniform over 3, q|C = (1/2, 1/4, 1/4): KL = (1/3)(log(2/3) + 2 log(4/3)).
  want = (math.log(2 / 3) + 2 * math.log(4 / 3)) / 3
  assert conditional_kl(np.log([1 / 3] * 3), np.log([0.5, 0.25, 0.25])) == pytest.approx(want,
                                                                                         rel=1e-12)
  # Only the preference on the set matters: mass outside it (unnormalised inputs) does not.
  assert conditional_kl(np.log([0.01] * 3), np.log([0.2, 0.1, 0.1])) == pytest.approx(want,
                                                                                      rel=1e-12)
  assert conditional_kl(np.log([0.3, 0.2, 0.1]), np.log([0.3, 0.2, 0.1])) == pytest.approx(
      0.0, abs=1e-12)
  # A point mass on answer 0 against q|C: KL = -log q|C(0).
  assert conditional_kl(np.array([0.0, -np.inf, -np.inf]), np.log([0.5, 0.25, 0.25])) == (
      pytest.approx(math.log(2), rel=1e-12))
  # q giving 0 to an answer p keeps: infinite.
  assert conditional_kl(np.log([0.5, 0.5]), np.array([0.0, -np.inf])) == math.inf


def test_equals_the_exact_evaluators_kl_on_the_correct_set():
  rng = np.random.default_rng(0)
  lp, lr = rng.normal(-5, 2, 9), rng.normal(-5, 2, 9)
  assert conditional_kl(lp, lr) == pytest.approx(correct_set_terms(lp, lr, 15.0).kl_correct,
                                                 rel=1e-9)


def test_bad_inputs():
  with pytest.raises(ValueError, match=r"shapes \(2,\) and \(3,\)"):
    conditional_kl(np.zeros(2), np.zeros(3))
  with pytest.raises(ValueError, match="NaN"):
    conditional_kl(np.array([0.0, np.nan]), np.zeros(2))
