"""Final-answer extraction and answer normalisation (pure string functions, no math-verify)."""

import time

import pytest

from disa_jax.rewards import math_answer as ma


@pytest.mark.parametrize("text,expected", [
  ("so \\boxed{5}.", "5"),
  ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
  ("nested \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)} end",
   "\\left( 3, \\frac{\\pi}{2} \\right)"),
  ("\\fbox{7}", "7"),
  ("$\\boxed 42$", "42"),
  ("escaped \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
  ("\\boxed{ 3 }", "3"),
  ("no box here", None),
  ("unbalanced \\boxed{3", None),
])
def test_extract_boxed(text, expected):
  assert ma.extract_boxed(text) == expected


@pytest.mark.parametrize("text,expected", [
  ("... The final answer is $12$. I hope it is correct.", "12"),
  ("Final Answer: The final answer is \\frac{3}{4}.", "\\frac{3}{4}"),
  ("work\n**Answer:** 7\n", "7"),
  ("Answer: $x = 2$", "x = 2"),
  ("The final answer is 3 but \\boxed{4}", "4"),  # boxed wins
  ("I am not sure.", None),
  ("\\boxed{}", None),
])
def test_extract_final_answer(text, expected):
  assert ma.extract_final_answer(text) == expected


@pytest.mark.parametrize("answer,variant", [
  ("025", "25"),
  ("007", "7"),
  ("1.5e3", "1500"),
  ("2E-2", "0.02"),
  ("1.5 \\times 10^{3}", "1500"),
  ("3\\cdot10^8", "300000000"),
  ("10\\text{ cm}", "10"),
  ("10 cm", "10"),
  ("45^\\circ", "45"),
  ("45^{\\circ}", "45"),
  ("30 degrees", "30"),
  ("50\\%", "50"),
  ("\\$5", "5"),
  ("\\text{(C)}", "(C)"),
  ("1,000,000", "1000000"),
  ("3 \\mathrm{m/s}", "3"),
  ("12 \\text{ square units}", "12"),
])
def test_answer_variants_contains(answer, variant):
  assert variant in ma.answer_variants(answer)


@pytest.mark.parametrize("answer,not_variant", [
  ("0.25", "25"),      # only integers lose their zero padding
  ("0.25", ".25"),
  ("x^2 cm", "x^2"),   # units are stripped after numbers only
  ("2^{10}", "2"),
  ("1,2", "12"),       # a list, not a thousands separator
  ("10^{3}", "10"),
])
def test_answer_variants_never_changes_values(answer, not_variant):
  assert not_variant not in ma.answer_variants(answer)


def test_answer_variants_raw_first_except_e_notation():
  assert ma.answer_variants("\\frac{1}{2}")[0] == "\\frac{1}{2}"
  # LaTeX would read 2e3 as 2*e*3, so the raw form is dropped.
  assert "2e3" not in ma.answer_variants("2e3")
  assert ma.answer_variants("2e3")[0] == "2\\times 10^{3}"


def test_ground_truth_alternatives():
  assert ma.ground_truth_alternatives("5") == ["5"]
  assert ma.ground_truth_alternatives(27.0) == ["27.0"]
  assert ma.ground_truth_alternatives(["$3$", "3", "$\\frac{1}{2}$"]) == ["3", "\\frac{1}{2}"]
  assert ma.ground_truth_alternatives("the answer \\boxed{12}") == ["12"]
  with pytest.raises(ValueError, match="ground_truth"):
    ma.ground_truth_alternatives([])
  with pytest.raises(ValueError, match="unsupported"):
    ma.ground_truth_alternatives([None])


def test_extraction_is_linear_on_huge_inputs():
  big = "\\boxed{" * 50_000 + "x" * 1_000_000
  t0 = time.perf_counter()
  assert ma.extract_final_answer(big) is None
  assert ma.answer_variants("9" * 100_000 + " cm") == ["9" * 100_000 + " cm"]
  for s in ("1 " * 995, "1^{" * 600, "1\\text{a}" * 200):  # near the length limit
    ma.answer_variants(s)
  assert time.perf_counter() - t0 < 5.0
