"""Stage identities (`disa_jax.checkpoint.identity`): content fingerprints, resume / refuse / overwrite."""
import json

import pytest

from disa_jax.checkpoint import identity
from disa_jax.checkpoint.identity import IdentityMismatchError, claim_output, fingerprint


def test_fingerprint_follows_content_not_metadata(tmp_path):
  f = tmp_path / "a.bin"
  f.write_bytes(b"x" * 3000)
  before = fingerprint(f)
  f.write_bytes(b"x" * 2999 + b"y")  # same size
  assert fingerprint(f) != before
  d = tmp_path / "model"
  d.mkdir()
  (d / "w.safetensors").write_bytes(b"weights")
  (d / "config.json").write_text("{}")
  fp = fingerprint(d)
  (d / ".lock").write_text("123")  # a writer's lock and a killed writer's temporary are not content
  (d / "part.tmp").write_text("junk")
  assert fingerprint(d) == fp
  (d / "w.safetensors").write_bytes(b"weightz")
  assert fingerprint(d) != fp
  (d / "w.safetensors").write_bytes(b"weights")
  (d / "w.safetensors").rename(d / "v.safetensors")  # names are content too
  assert fingerprint(d) != fp
  with pytest.raises(FileNotFoundError, match="nope"):
    fingerprint(tmp_path / "nope")


def test_claim_resumes_refuses_naming_every_field_and_overwrites(tmp_path):
  data = tmp_path / "in.jsonl"
  data.write_text("1\n")
  path = tmp_path / "out" / "identity.json"
  ident = {**identity.inputs(data=str(data)), "beta": 15.0, "sampling": {"n": 8}, "ids": (1, 2)}
  discarded = []
  assert claim_output(path, ident, overwrite=False, has_output=False, discard=None) == "new"
  kw = dict(has_output=True, discard=lambda: discarded.append(1))  # the stage wrote outputs
  assert claim_output(path, ident, overwrite=False, **kw) == "resumed"  # tuples stored as lists
  data.write_text("2\n")
  other = {**identity.inputs(data=str(data)), "beta": 10.0, "sampling": {"n": 8}, "ids": (1, 2)}
  with pytest.raises(IdentityMismatchError) as e:
    claim_output(path, other, overwrite=False, **kw)
  assert set(e.value.diffs) == {"data.sha256", "beta"}
  assert "beta: stored 15.0, this run 10.0" in str(e.value) and "overwrite=True" in str(e.value)
  assert not discarded and json.loads(path.read_text())["beta"] == 15.0  # nothing changed
  assert claim_output(path, other, overwrite=True, **kw) == "overwritten"
  assert discarded == [1] and json.loads(path.read_text())["beta"] == 10.0


def test_outputs_without_an_identity_are_refused(tmp_path):
  path = tmp_path / "identity.json"
  with pytest.raises(IdentityMismatchError, match="identity.json is missing"):
    claim_output(path, {"a": 1}, overwrite=False, has_output=True, discard=lambda: None)
  assert not path.exists()


def test_a_differing_identity_without_outputs_is_replaced(tmp_path):
  """A first run that stopped before writing anything (a bad setting) does not block the next."""
  path = tmp_path / "identity.json"
  kw = dict(overwrite=False, has_output=False, discard=lambda: None)
  assert claim_output(path, {"drop": False}, **kw) == "new"
  assert claim_output(path, {"drop": True}, **kw) == "new"
  assert json.loads(path.read_text()) == {"drop": True}


def test_remove_paths_deletes_files_and_trees_and_skips_the_absent(tmp_path):
  (tmp_path / "tree" / "sub").mkdir(parents=True)
  (tmp_path / "tree" / "sub" / "x").write_text("1")
  (tmp_path / "file.json").write_text("{}")
  (tmp_path / "kept").write_text("k")
  (tmp_path / "link").symlink_to(tmp_path / "kept")
  identity.remove_paths([tmp_path / "tree", str(tmp_path / "file.json"), tmp_path / "absent",
                         tmp_path / "link"])
  assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]  # a link goes, not its target


def test_an_owned_output_is_locked_and_claimed_on_its_owner_only(tmp_path):
  """`owned_output`: the owner holds the lock and runs the claim first (a second owner is refused
  naming the output; a failed claim releases the lock); a non-owner neither locks nor claims."""
  from disa_jax.checkpoint.lock import OutputLockedError, owned_output
  calls = []
  with owned_output(tmp_path / ".lock", "the test output", lambda: calls.append("claim")):
    assert calls == ["claim"]
    with pytest.raises(OutputLockedError, match="the test output"):
      with owned_output(tmp_path / ".lock", "the test output", lambda: calls.append("no")):
        pass
    with owned_output(tmp_path / ".lock", "the test output", lambda: calls.append("other"),
                      owner=False):
      pass
  assert calls == ["claim"]

  def refuse():
    raise ValueError("another run's output")

  with pytest.raises(ValueError, match="another run's output"):
    with owned_output(tmp_path / ".lock", "the test output", refuse):
      pass
  with owned_output(tmp_path / ".lock", "the test output", lambda: None):  # released again
    pass
