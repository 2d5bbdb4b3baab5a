"""The main job's pinned models (issue 62): a fresh workdir copies them (no training) and its report
records their hashes; a changed pinned file is refused, naming it and both hashes; with
``rebuild_models`` the job trains its own and says whether the hash changed."""
import dataclasses
import json
import shutil

import pytest

from configs import main as main_config
from disa_jax.checkpoint.identity import fingerprint
from disa_jax.pipeline import pinned, sum_job
from disa_jax.pipeline.job_config import MainConfig
from disa_jax.pipeline.provenance import provenance
from disa_jax.pipeline.sum_job import SumJob



def _entry_rows(columns: int) -> list[list[str]]:
  """The cells of the store README's table rows of ``columns`` cells that name an entry (16 hex
  digits) in their first cell."""
  rows = []
  for line in (pinned.STORE / "README.md").read_text().splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if line.startswith("| ") and len(cells) == columns and len(cells[0]) == 16:
      rows.append(cells)
  return rows


def _pinned_table() -> dict[str, str]:
  """{preset: entry} from the table of disa_jax/pipeline/pinned_models/README.md."""
  return {p: entry for entry, presets in _entry_rows(2) for p in presets.split(", ")}


PINNED_PRESETS = tuple(_pinned_table())


def _build_table() -> list[tuple[str, dict[str, int], str]]:
  """[(entry, {config path: warm-up seed}, preset)] from the store README's table of other builds
  (rows '| entry | path=seed path=seed | preset, preset |')."""
  return [(entry, {k: int(v) for k, v in (kv.split("=") for kv in seeds.split())}, p)
          for entry, seeds, presets in _entry_rows(3) if "=" in seeds
          for p in presets.split(", ")]


BUILDS = _build_table()


def _job(c, workdir) -> SumJob:
  return SumJob(MainConfig.from_config(c), workdir, progress=False)


def _no_training(monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("a pinned model was trained")
  monkeypatch.setattr(sum_job, "train_sum_model", refuse)


def test_the_store_table_names_every_entry():
  assert "default" in PINNED_PRESETS and "staleness_study" in PINNED_PRESETS
  entries = {p.name for p in pinned.STORE.iterdir() if p.is_dir()}
  assert set(_pinned_table().values()) | {e for e, _, _ in BUILDS} == entries


def test_every_preset_is_pinned_or_named_as_not_pinned():
  """A preset added to configs/main.py is listed in the store's table (and so checked below) or
  in its 'Not pinned' line; none is left out of both."""
  text = (pinned.STORE / "README.md").read_text()
  unpinned = next(l for l in text.splitlines() if l.startswith("Not pinned"))
  unpinned = {p.strip(" .") for p in unpinned.split(":", 1)[1].split(",")}
  names = {"default" if p == "" else p for p in main_config.PRESETS}
  assert names - set(PINNED_PRESETS) - unpinned == set()
  assert not set(PINNED_PRESETS) & unpinned and unpinned <= names


@pytest.mark.parametrize("preset", PINNED_PRESETS)
def test_each_pinned_preset_has_an_intact_store_entry(preset):
  cfg = MainConfig.from_config(main_config.get_config("" if preset == "default" else preset))
  entry = pinned.STORE / pinned.identity(cfg).key
  assert entry.name == _pinned_table()[preset]
  record = pinned.verify(entry)  # every file against its sha256
  assert record.identity == pinned.identity(cfg) and record.key == entry.name
  assert record.bytes < 8 * 2 ** 20  # tiny models: a few MB at most
  assert record.fingerprint == {m: fingerprint(entry / m) for m in pinned.MODELS}


@pytest.mark.parametrize("entry,seeds,preset", BUILDS,
                         ids=[f"{p}-{e}" for e, _, p in BUILDS])
def test_each_other_build_is_its_preset_with_other_warmup_seeds_and_intact(entry, seeds, preset):
  """A second build of a preset's models (issue 62, item 5): the same spec but the warm-up seeds,
  its own intact entry; the preset run with those seeds copies it."""
  c = main_config.get_config(preset)
  first = pinned.identity(MainConfig.from_config(c))
  c.update_from_flattened_dict(seeds)
  other = pinned.identity(MainConfig.from_config(c))
  assert other.key == entry != first.key
  assert dataclasses.replace(other, reference=dataclasses.replace(
      other.reference, seed=first.reference.seed), proposal=dataclasses.replace(
          other.proposal, seed=first.proposal.seed)) == first
  record = pinned.verify(pinned.STORE / entry)
  assert record.identity == other and record.bytes < 8 * 2 ** 20
  assert record.fingerprint != pinned.verify(pinned.STORE / _pinned_table()[preset]).fingerprint


def test_a_fresh_workdir_copies_the_pinned_models_and_records_their_hashes(tmp_path, monkeypatch):
  _no_training(monkeypatch)
  job = _job(main_config.get_config(), tmp_path)
  src = job.build_models()
  entry = pinned.STORE / src.key
  want = json.loads((entry / "pin.json").read_text())["fingerprint"]
  assert src.source == "pinned" and src.fingerprint == src.pinned_fingerprint == want
  assert src.fingerprint["reference"] == fingerprint(job.ref_path)
  prov = provenance(src)
  assert prov.models.fingerprint == want and prov.packages["jax"]
  assert job.build_models() == src  # a resumed job keeps them, checked against its record


def test_a_copy_killed_midway_is_finished_by_the_rerun_and_a_foreign_model_refused(
    tmp_path, monkeypatch):
  """A job killed while it copied the pin leaves pi_ref copied and p_T half copied (a ``.partial``
  folder, no record): the rerun keeps the finished copy, replaces the half one and records the
  pin; a model there that is not the pin's is refused, not trusted."""
  _no_training(monkeypatch)
  cfg = MainConfig.from_config(main_config.get_config())
  entry = pinned.STORE / pinned.identity(cfg).key
  models = tmp_path / "job" / "models"
  shutil.copytree(entry / "reference", models / "reference")
  (models / "proposal.partial").mkdir()
  (models / "proposal.partial" / "model.safetensors").write_bytes(b"half")
  src = _job(main_config.get_config(), tmp_path / "job").build_models()
  assert src.source == "pinned" and not (models / "proposal.partial").exists()
  assert src.fingerprint == json.loads((entry / "pin.json").read_text())["fingerprint"]
  other = tmp_path / "other" / "models"
  shutil.copytree(entry / "reference", other / "reference")
  (other / "reference" / "model.safetensors").write_bytes(b"not the pin")
  with pytest.raises(pinned.PinnedModelError, match="holds models without"):
    _job(main_config.get_config(), tmp_path / "other").build_models()


def _tampered_store(tmp_path, monkeypatch) -> str:
  """A copy of the default job's store entry with one byte of pi_ref's weights changed."""
  cfg = MainConfig.from_config(main_config.get_config())
  key = pinned.identity(cfg).key
  shutil.copytree(pinned.STORE / key, tmp_path / "store" / key)
  monkeypatch.setattr(pinned, "STORE", tmp_path / "store")
  weights = tmp_path / "store" / key / "reference" / "model.safetensors"
  data = bytearray(weights.read_bytes())
  data[-1] ^= 1
  weights.write_bytes(bytes(data))
  return str(weights)


def test_a_changed_pinned_file_is_refused_naming_it_and_both_hashes(tmp_path, monkeypatch):
  weights = _tampered_store(tmp_path, monkeypatch)
  _no_training(monkeypatch)
  with pytest.raises(pinned.PinnedModelError) as e:
    _job(main_config.get_config(), tmp_path / "job").build_models()
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith(f"pinned model file {weights} has sha256 ")
  assert len([w for w in msg.replace(",", " ").replace(":", " ").split() if len(w) == 64]) == 2, msg


def _tiny(seed: int = 0, rebuild: bool = False):
  c = main_config.get_config()
  c.reference_model.steps, c.proposal_model.steps = 3, 2
  c.reference_model.seed = seed
  c.rebuild_models = rebuild
  return c


@pytest.mark.slow  # ~15 s: two tiny warm-ups
def test_rebuild_trains_here_and_says_whether_the_hash_changed(tmp_path, monkeypatch):
  monkeypatch.setattr(pinned, "STORE", tmp_path / "store")
  # "another machine's build" of the same identity: other weights (another init seed) pinned under it
  other = _job(_tiny(seed=5), tmp_path / "other")
  src = other.build_models()
  assert src.source == "trained" and src.key == "" and src.pinned_fingerprint == {}  # no pin
  pinned.pin(other.dir / "models", pinned.identity(MainConfig.from_config(_tiny())))
  logs = []
  monkeypatch.setattr(pinned, "print", logs.append, raising=False)
  again = _job(_tiny(rebuild=True), tmp_path / "again").build_models()
  assert again.source == "trained" and again.fingerprint["reference"] != src.fingerprint["reference"]
  assert again.pinned_fingerprint == src.fingerprint
  assert any(l.startswith("models: reference made on this machine") and
             l.endswith("the hash changed") for l in logs), logs
  with pytest.raises(pinned.PinnedModelError, match="trained on this machine .* not the pinned"):
    _job(_tiny(), tmp_path / "again").build_models()  # resumed without rebuild_models
  _no_training(monkeypatch)
  fresh = _job(_tiny(), tmp_path / "fresh").build_models()
  assert fresh.source == "pinned" and fresh.fingerprint == again.pinned_fingerprint


@pytest.mark.slow  # ~20 s: Stage 1, the exact log Z and Stage 2 of the default job's 8 prompts
def test_the_anchor_report_of_a_fresh_job_records_the_pinned_hashes(tmp_path, monkeypatch):
  _no_training(monkeypatch)
  c = main_config.get_config()
  c.stages = "anchor"
  c.stage1.sampling.n, c.stage2.samples, c.stage2.fit.epochs, c.n_study = 8, 4, 5, (2, 4)
  _job(c, tmp_path).run()
  saved = json.loads((tmp_path / "anchor_report.json").read_text())["provenance"]
  assert saved["models"]["source"] == "pinned"
  for m in pinned.MODELS:
    assert saved["models"]["fingerprint"][m] == fingerprint(tmp_path / "models" / m)
    assert saved["models"]["fingerprint"][m] == saved["models"]["pinned_fingerprint"][m]
  assert saved["packages"]["jax"] and saved["cpu"]
