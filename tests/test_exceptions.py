"""Every exception class of `disa_jax` survives pickling: a Stage 3 run of the main job raises in a
worker process (`SumJob.stage3_all`), and an exception that cannot be rebuilt from its pickle
breaks the whole process pool (BrokenProcessPool for every run) instead of naming the cause."""
import importlib
import inspect
import pickle
import pkgutil
from pathlib import Path

import pytest

import disa_jax
from disa_jax.checkpoint.identity import IdentityMismatchError
from disa_jax.checkpoint.lock import OutputLockedError
from disa_jax.checkpoint.manager import CheckpointSaveError
from disa_jax.workflows.prepare_data import SourceUnavailableError
from disa_jax.estimators.dataset import Stage1FormatError
from disa_jax.workflows.pinned_prompts import ChangedPromptsError

# Modules that need an optional dependency or start work when imported are not scanned.
_SKIP = ("disa_jax.rewards._humaneval_runner", "disa_jax.rewards._sandbox_boot")

EXAMPLES = [
    OutputLockedError(Path("/tmp/x/.lock"), 1234, "the Stage 3 run /tmp/x"),
    CheckpointSaveError("disk full at step 7", step=7, latest_step=5, disk_full=True),
    IdentityMismatchError(Path("/tmp/x/identity.json"), {"beta": (15.0, 10.0)}),
    Stage1FormatError("/tmp/s1.jsonl", [(3, "no samples")]),
    SourceUnavailableError("BytedTsinghua-SIA/DAPO-Math-17k", "the hub does not answer"),
    ChangedPromptsError("the prompt file 'p.parquet' changed since Stage 1 graded its samples"),
]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_an_exception_comes_back_from_a_pickle_with_its_message_and_fields(error):
  back = pickle.loads(pickle.dumps(error))
  assert type(back) is type(error) and str(back) == str(error)
  assert {k: v for k, v in vars(back).items()} == {k: v for k, v in vars(error).items()}


def _exception_classes():
  for info in pkgutil.walk_packages(disa_jax.__path__, "disa_jax."):
    if info.name in _SKIP:
      continue
    module = importlib.import_module(info.name)
    for _, cls in inspect.getmembers(module, inspect.isclass):
      if issubclass(cls, BaseException) and cls.__module__ == info.name:
        yield cls


def test_every_exception_with_its_own_constructor_is_among_the_examples():
  custom = {c for c in _exception_classes()
            if "__init__" in vars(c) and inspect.signature(c.__init__).parameters.keys()
            - {"self", "args", "kwargs"}}
  assert custom, "the scan found no exception class with its own constructor"
  assert custom <= {type(e) for e in EXAMPLES}, sorted(c.__name__ for c in custom)
