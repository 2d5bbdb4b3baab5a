"""`disa_jax.eval.exact`: the wrong-answer term of the KL decomposition is unbiased (checked on an
enumerable distribution over many seeds), and each tracked measurement draws its own samples."""
import numpy as np
import pytest

from disa_jax import codec
from disa_jax.eval import exact as X

# Six outcomes, the first two correct. The policy puts little mass on the wrong ones (P_w = 0.03),
# where a zero fill for "no wrong sample drawn" loses most of the term at k = 8.
POLICY = np.asarray([0.55, 0.42, 0.015, 0.01, 0.004, 0.001])
REF = np.asarray([0.3, 0.3, 0.1, 0.1, 0.1, 0.1])
REWARD = np.asarray([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def _exact_term() -> float:
  w = REWARD < 0.5
  pw, pw_ref = POLICY[w].sum(), REF[w].sum()
  return float(pw * np.sum(POLICY[w] / pw * np.log((POLICY[w] / pw) / (REF[w] / pw_ref))))


def _draws(k: int, repeats: int, seed: int = 0):
  idx = np.random.default_rng(seed).choice(POLICY.size, size=(repeats, k), p=POLICY)
  return np.log(POLICY[idx]), np.log(REF[idx]), REWARD[idx]


def test_the_wrong_term_is_unbiased_where_a_zero_fill_is_not():
  k, repeats = 8, 20000
  lp, lr, rw = _draws(k, repeats)
  pc, pc_ref = POLICY[:2].sum(), REF[:2].sum()
  est = np.asarray([X.wrong_term(lp[i], lr[i], rw[i], pc, pc_ref) for i in range(repeats)])
  truth = _exact_term()
  mean, se = est[:, 0].mean(), est[:, 0].std(ddof=1) / np.sqrt(repeats)
  assert abs(mean - truth) < 4 * se, (mean, truth, se)
  # its standard error matches the spread of the estimate over seeds
  assert np.sqrt(np.mean(est[:, 1] ** 2)) == pytest.approx(est[:, 0].std(), rel=0.1)
  # the estimate the report used before: the conditional mean over wrong samples times P_w, 0
  # when no wrong sample is drawn, keeps about 1 - P_c^k of the term
  zero_fill = []
  for i in range(repeats):
    w = rw[i] < 0.5
    zero_fill.append((1 - pc) * np.mean(lp[i][w] - np.log(1 - pc) - lr[i][w] + np.log(1 - pc_ref))
                     if w.any() else 0.0)
  assert np.mean(zero_fill) < 0.5 * truth


def test_monte_carlo_terms_use_the_unbiased_wrong_term_without_wrong_samples():
  lp, lr, rw = np.log(POLICY[:2]), np.log(REF[:2]), REWARD[:2]  # two correct samples only
  terms = X.correct_set_terms(np.log(POLICY[:2]), np.log(REF[:2]), beta=2.0)
  mc = X.monte_carlo_terms(lp, lr, rw, terms, beta=2.0)
  pw, pw_ref = 1 - POLICY[:2].sum(), 1 - REF[:2].sum()
  assert mc["wrong_samples"] == 0 and np.isnan(mc["kl_wrong"])
  assert mc["p_wrong_kl_wrong"] == pytest.approx(pw * np.log(pw_ref / pw))  # not 0
  assert mc["p_wrong_kl_wrong_se"] == 0.0


def test_a_wrong_sample_where_the_reference_gives_no_wrong_mass_is_refused():
  with pytest.raises(ValueError, match="P_ref\\(wrong\\) = 0.0"):
    X.wrong_term(np.log([0.5, 0.5]), np.log([0.5, 0.5]), np.asarray([0.0, 1.0]), 0.9, 1.0)


def test_each_measurement_step_draws_its_own_seed():
  seeds = [X.measurement_seed(8, s) for s in range(0, 3600, 100)]
  assert len(set(seeds)) == len(seeds) and all(0 <= s < 2 ** 31 for s in seeds)
  assert X.measurement_seed(8, 100) == X.measurement_seed(8, 100)  # reproducible
  assert X.measurement_seed(9, 100) != X.measurement_seed(8, 100)
  with pytest.raises(ValueError, match="step must be >= 0, got -1"):
    X.measurement_seed(8, -1)


class _Stop(Exception):
  pass


def test_the_tracker_samples_each_measurement_with_its_steps_seed():
  """ExactTracker.measure passes measurement_seed(cfg.seed, step) to the engine (the old tracker
  reused cfg.seed at every step, so consecutive measurements shared their samples)."""
  seeds = []

  class Engine:
    def generate(self, prompts, params):
      seeds.append(params.seed)
      raise _Stop

  class Scorer:
    def pack(self, prompts, responses, *, reuse=None):
      return responses

    def token_logprobs_packed(self, responses):
      return [np.zeros(len(r), np.float32) for r in responses]

  tracker = X.ExactTracker.__new__(X.ExactTracker)  # only what measure reads before sampling
  tracker.cfg = X.ExactTargetConfig(kl_samples=4, seed=8)
  tracker.tokenizer = type("Tok", (), {"eos_token_id": 2})()
  tracker.prompts, tracker.max_tokens = [[5, 6]], 8
  tracker._flat_p, tracker._flat_c = [[5, 6]], [[7, 2]]
  tracker._bounds, tracker._lp_ref = np.asarray([0, 1]), np.zeros(1)
  tracker._correct_packed = None
  for step in (100, 200):
    with pytest.raises(_Stop):
      tracker.measure(Engine(), Scorer(), step=step)
  assert seeds == [X.measurement_seed(8, 100), X.measurement_seed(8, 200)]


def test_correct_set_terms_is_a_frozen_record_of_one_prompt():
  t = X.correct_set_terms(np.log(POLICY[:2]), np.log(REF[:2]), beta=2.0)
  assert isinstance(t, X.CorrectSetTerms)
  assert list(codec.encode(t)) == ["log_z", "p_correct", "p_correct_ref", "p_correct_target",
                               "entropy_correct", "target_entropy_correct", "kl_correct",
                               "kl_binary"]
  assert t.p_correct == pytest.approx(POLICY[:2].sum()) and t.log_z == X.exact_log_z(
      np.log(REF[:2].sum()), 2.0)
  with pytest.raises(AttributeError):
    t.log_z = 0.0
  with pytest.raises(ValueError, match=r"logp_policy \(2,\) and logp_ref \(3,\)"):
    X.correct_set_terms(np.log(POLICY[:2]), np.log(REF[:3]), beta=2.0)


def test_exact_measures_need_every_measure():
  with pytest.raises(ValueError, match=r"ExactMeasures.means lacks measures \['tb_sq'\]"):
    X.ExactMeasures(means={k: 0.0 for k in X.MEASURES if k != "tb_sq"}, samples_per_prompt=2,
                    per_prompt=())
