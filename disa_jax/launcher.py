"""What every `launch/*.py` command shares: flags, config paths, `--dry_run`, one-line errors.

    launcher.run(_CONFIG, Stage3Config.from_config, run_stage3)   # a config-file command
    launcher.run_app(main)                                         # a command with its own flags

- ``--config=configs/x.py:arg`` works from any directory: a relative config path that does not
  exist here is taken relative to the repository root.
- The ConfigDict (with ``--config.field=value`` overrides) is converted once into the command's
  typed config and checked by `disa_jax.workflows.preflight` before any weights load: the inputs
  (`preflight.preflight`), then the outputs (`preflight.check_outputs`: writable, and under
  ``--dry_run`` the identity of what a rerun would resume, naming ``overwrite``).
- ``--dry_run`` prints the typed config (stdout, JSON; the preflight notes go to stderr), then
  exits.
- A user mistake is ONE line on stderr, ``error: ...``, and exit code 2, in every entry point: a
  flag that does not parse (absl's own errors included), an unknown or ill-typed config field, a
  bad value, a missing or unwritable path, an output holding another run's results
  (`IdentityMismatchError`) or locked by another writer (`OutputLockedError`), a resume without a
  usable checkpoint (`CheckpointUnreadableError`). A warning is one ``warning: ...`` line. ``--verbose``
  re-raises it with its traceback. Other errors of the run itself keep their traceback.
- Only process 0 of a multi-process run prints the config, the notes and the result
  (`is_main_process`, which needs no JAX backend).
"""
from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import runpy
import signal
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from disa_jax import config as config_lib
from disa_jax import preemption
from disa_jax.checkpoint.files import OutputWriteError
from disa_jax.checkpoint.identity import IdentityMismatchError
from disa_jax.checkpoint.lock import OutputLockedError
from disa_jax.checkpoint.verify import CheckpointUnreadableError
from disa_jax.parallel import distributed
from disa_jax.workflows.preflight import check_outputs, preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE_EXIT = 2
# Raised while parsing, converting and checking: config overrides (ml_collections: AttributeError /
# KeyError / TypeError), absl flags (flags.Error), typed-config conversion and preflight
# (ValueError), missing, unreadable or unwritable paths (OSError: FileNotFoundError,
# PermissionError, a full disk).
USER_ERRORS = (ValueError, KeyError, AttributeError, TypeError, OSError, flags.Error)
# User mistakes a run finds itself (after the checks), and an output it cannot write (a full or
# read-only disk, the error naming the file): one line too.
# A resume that finds no usable checkpoint is one line too (`CheckpointUnreadableError`).
RUN_USER_ERRORS = (IdentityMismatchError, OutputLockedError, OutputWriteError,
                   CheckpointUnreadableError)
VERBOSE = ("--verbose", "--verbose=true", "--verbose=True", "--verbose=1")


def resolve_config_arg(arg: str) -> str:
  """``--config=PATH[:arg]`` with a relative PATH missing here -> the repository's PATH."""
  for prefix in ("--config=", "-config="):
    if arg.startswith(prefix):
      path, sep, rest = arg[len(prefix):].partition(":")
      if path and not os.path.isabs(path) and not os.path.exists(path):
        candidate = os.path.join(ROOT, path)
        if os.path.exists(candidate):
          return f"{prefix}{candidate}{sep}{rest}"
  return arg


def _text(error: BaseException) -> str:
  """The error's message on one line: a KeyError's own text, not its quoted repr (ml_collections
  nests those: ``AttributeError(repr(KeyError(...)))``), and of an error a config file raised
  (quoted by ml_collections with its traceback) the flag and the error's last line."""
  text = error.args[0] if len(error.args) == 1 and isinstance(error.args[0], str) else str(error)
  while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
    try:
      text = str(ast.literal_eval(text))
    except (ValueError, SyntaxError):
      break
  if "Traceback (most recent call last)" in text:
    lines = [l for l in text.splitlines() if l.strip()]
    text = f"{lines[0]} {lines[-1]}"
  return " ".join(text.split()) or type(error).__name__


def _override_flags(error: BaseException, argv: Sequence[str]) -> list[str]:
  """The ``--config.<field>`` flags of ``argv`` whose field an unknown-field error names."""
  text = _text(error)
  names = [a.split("=", 1)[0].lstrip("-") for a in argv if a.startswith("--config.")]
  return [f"--{n}" for n in names if n.split(".")[-1] in text or n[len("config."):] in text]


def one_line(error: BaseException, argv: Sequence[str] = ()) -> str:
  """The error as one line; a config override that failed is named with its flag."""
  text = _text(error)
  if isinstance(error, (AttributeError, KeyError)):
    named = _override_flags(error, argv)
    if named:
      return f"unknown config field in {', '.join(named)}: {text}"
  if isinstance(error, (KeyError, TypeError)):
    return f"{type(error).__name__}: {text}"
  return text


_FORMAT_WARNING = warnings.formatwarning


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
  """A warning as one ``warning: ...`` line (without ``--verbose``: not its source line)."""
  del category, filename, lineno, line
  return f"warning: {' '.join(str(message).split())}\n"


def _fail(error: BaseException, argv: Sequence[str]) -> None:
  print(f"error: {one_line(error, argv)}  (--verbose for the traceback)", file=sys.stderr,
        flush=True)
  sys.exit(USAGE_EXIT)


def is_main_process() -> bool:
  """Process 0 of a multi-process run, from the launcher's environment (`distributed.detect_launch`:
  DISA_PROCESS_ID, SLURM_PROCID), so before JAX starts; a TPU pod asks JAX; a single process is."""
  try:
    spec = distributed.detect_launch()
  except ValueError:
    return True
  if spec.process_id is not None:
    return spec.process_id == 0
  return jax.process_index() == 0  # a TPU pod, once jax.distributed has joined it


def define_run_flags() -> None:
  """--dry_run and --verbose, for a command with flags of its own (`run_app`)."""
  preemption.exit_until_started()
  flags.DEFINE_bool("dry_run", False, "Validate the config, mesh, lengths, paths and outputs (no "
                    "weights load), print it, then exit.")
  flags.DEFINE_bool("verbose", False, "User mistakes with their traceback.")


def define_flags(config_help: str, default_config: str | None = None) -> Any:
  """Defines --config (a config file; ``default_config`` relative to the repository root),
  --dry_run and --verbose; returns the --config holder."""
  default = None if default_config is None else os.path.join(ROOT, default_config)
  preemption.exit_until_started()  # a SIGTERM while the flags parse: exit 0, one line
  with user_errors(sys.argv):  # a default config is parsed, with the overrides, right here
    holder = config_flags.DEFINE_config_file("config", default, config_help)
  define_run_flags()
  if default_config is None:
    flags.mark_flag_as_required("config")
  return holder


def _parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing with its errors (FATAL, exit 1) as one line and exit code 2."""
  try:
    return flags.FLAGS(list(argv))
  except flags.Error as e:
    if any(a in VERBOSE for a in argv):
      raise
    _fail(e, argv)


@contextlib.contextmanager
def user_errors(argv: Sequence[str], started: Callable[[], bool] = lambda: False) -> Iterator[None]:
  """A user mistake raised inside (`USER_ERRORS` until ``started()``, `RUN_USER_ERRORS` always)
  becomes one ``error:`` line on stderr and exit code 2; ``--verbose`` in ``argv`` re-raises it."""
  verbose = any(a in VERBOSE for a in argv)
  try:
    yield
  except RUN_USER_ERRORS as e:
    if verbose:
      raise
    _fail(e, argv)
  except USER_ERRORS as e:
    if verbose or started():
      raise
    _fail(e, argv)


def run_app(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None,
            started: Callable[[], bool] = lambda: False, begins_at_entry: bool = True) -> None:
  """`absl.app.run(main)` with its flag errors and the user mistakes of `user_errors` as one
  ``error:`` line and exit code 2.

  Args:
    main: the command (parsed argv -> exit code or None).
    argv: the command line (default ``sys.argv``); ``--config=`` paths resolved from the repository.
    started: whether the run itself has begun (its other errors keep their traceback then).
    begins_at_entry: the run begins as ``main`` is entered (`preemption.started`); False: ``main``
      calls `preemption.started` itself.
  """
  def entry(args):
    if begins_at_entry:
      preemption.started()
    return main(args)

  argv = [resolve_config_arg(a) for a in (sys.argv if argv is None else argv)]
  # JAX logs at INFO which backends it could not open (e.g. libtpu on a GPU or CPU machine).
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  if not any(a in VERBOSE for a in argv):
    warnings.formatwarning = _one_line_warning
  with user_errors(argv, started):
    app.run(entry, argv=argv, flags_parser=_parse_flags)


def run(config: Any, convert: Callable[[Any], Any], execute: Callable[[Any], Any],
        argv: Sequence[str] | None = None,
        check: Callable[[Any], list[str]] | None = preflight) -> None:
  """Parses the flags, converts and checks the config, then runs ``execute(cfg)``.

  Args:
    config: the holder `define_flags` returned.
    convert: ConfigDict -> the typed config (may read other flags, e.g. --workdir).
    execute: runs the command; a returned mapping is printed as JSON (by process 0).
    argv: the command line (default ``sys.argv``).
    check: the input checks before any weights load (returns notes; None for jobs that build their
      own tiny models). The outputs of a typed config `preflight.CHECKS` knows are checked after
      it (`preflight.check_outputs`; their identity under --dry_run only: a run checks it itself).
  """
  running = []

  def main(args: Sequence[str]) -> None:
    if len(args) > 1:
      raise ValueError(f"unexpected arguments: {list(args[1:])} (flags are --name=value)")
    if not flags.FLAGS.verbose:
      absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save / restore at INFO
    dry_run = flags.FLAGS.dry_run
    cfg = convert(config.value)
    notes = check(cfg) if check is not None else []
    check_outputs(cfg, claims=dry_run)
    main_process = is_main_process()
    for note in notes if main_process else ():
      print(note, file=sys.stderr)  # stdout stays JSON
    if dry_run:
      if main_process:
        print(json.dumps(config_lib.to_dict(cfg), indent=1, default=str))
      return
    running.append(True)
    preemption.started()
    try:
      result = execute(cfg)
    except preemption.Stopped as e:  # saved at a resume point: the rerun resumes
      print(e, file=sys.stderr, flush=True)
      return
    if result is not None and main_process:
      print(json.dumps(result, indent=1, default=str))

  run_app(main, argv, started=lambda: bool(running), begins_at_entry=False)


def invoke(script: str, argv: Sequence[str]) -> int:
  """Runs a launch script in this process as ``python SCRIPT *argv`` would; returns its exit code.

  For tests and notebooks that run many commands (each process start costs seconds of imports):
  the flags the script defines are removed afterwards, so the next call defines them afresh.
  """
  before, old_argv = set(flags.FLAGS), sys.argv
  handlers = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  sys.argv = [script, *argv]  # ml_collections reads the --config.* overrides from sys.argv
  try:
    runpy.run_path(script, run_name="__main__")
    return 0
  except SystemExit as e:
    return e.code if isinstance(e.code, int) else int(e.code is not None)
  finally:
    sys.argv = old_argv
    warnings.formatwarning = _FORMAT_WARNING
    for sig, handler in handlers.items():
      signal.signal(sig, handler)
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
