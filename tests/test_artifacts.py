"""The stage artifacts (issue 28, item 1): each round-trips through its files, and a missing or
corrupt file raises `ArtifactError` naming the file (and the field)."""
import json

import numpy as np
import pytest

from disa_jax.artifacts import ArtifactError
from disa_jax.eval.exact import ExactTarget, correct_set_terms


def _exact():
  lp = {"sum0000": np.log([0.2, 0.1]), "sum0001": np.log([0.05, 0.3, 0.1])}
  return ExactTarget.from_logprobs(lp, 2.0)


def test_exact_target_round_trips_and_keeps_the_json_format(tmp_path):
  ex = _exact()
  assert ex.log_z.shape == (2,) and ex.beta == 2.0
  t = correct_set_terms(np.log([0.2, 0.1]), np.log([0.2, 0.1]), 2.0)
  assert ex.log_z[0] == t["log_z"] and ex.p_correct_ref[0] == t["p_correct_ref"]
  ex.save(tmp_path / "exact.json")
  assert ExactTarget.load(tmp_path / "exact.json") == ex
  raw = json.loads((tmp_path / "exact.json").read_text())  # the main job's exact.json keys
  assert list(raw) == ["prompt_ids", "log_z", "target_entropy_correct", "p_correct_ref", "beta"]
  assert ex.log_z_by_id() == dict(zip(raw["prompt_ids"], raw["log_z"]))
  np.testing.assert_array_equal(ex.log_z_of(["sum0001", "sum0000"]), ex.log_z[::-1])
  with pytest.raises(KeyError, match="sum0009"):
    ex.log_z_of(["sum0009"])


def test_exact_target_missing_or_corrupt_file_names_it(tmp_path):
  path = tmp_path / "exact.json"
  with pytest.raises(ArtifactError, match="exact.json does not exist"):
    ExactTarget.load(path)
  path.write_text("{not json")
  with pytest.raises(ArtifactError, match="exact.json is not readable JSON"):
    ExactTarget.load(path)
  _exact().save(path)
  raw = json.loads(path.read_text())
  path.write_text(json.dumps({k: v for k, v in raw.items() if k != "log_z"}))
  with pytest.raises(ArtifactError, match=r"exact.json: field 'log_z' is missing"):
    ExactTarget.load(path)
  path.write_text(json.dumps(raw | {"p_correct_ref": [0.1]}))
  with pytest.raises(ArtifactError, match=r"exact.json: field 'p_correct_ref' must hold 2"):
    ExactTarget.load(path)
  path.write_text(json.dumps(raw | {"beta": "2"}))
  with pytest.raises(ArtifactError, match=r"field 'beta' must be float"):
    ExactTarget.load(path)
