"""What every `launch/*.py` command shares: flags, config paths, `--dry_run`, one-line errors.

    launcher.run(Stage3Config.from_config, run_stage3, config_help="...", prepare=...)

- ``--config=configs/x.py:arg`` works from any directory: a relative config path that does not
  exist here is taken relative to the repository root.
- The ConfigDict (with ``--config.field=value`` overrides) is converted once into the command's
  typed config and checked by `disa_jax.workflows.preflight` before any weights load.
- ``--dry_run`` prints the typed config (stdout, JSON; the preflight notes go to stderr), then
  exits.
- A configuration or input error (unknown field, bad value, missing path) while parsing, converting
  or checking is ONE line on stderr, ``error: ...``, and exit code 2; ``--verbose`` re-raises it
  with its traceback. Errors of the run itself keep their traceback.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, Callable, Sequence

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

from disa_jax import config as config_lib
from disa_jax.workflows.preflight import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USAGE_EXIT = 2
# Raised by config overrides (ml_collections: AttributeError / KeyError / TypeError), typed-config
# conversion and preflight (ValueError), and missing files.
CONFIG_ERRORS = (ValueError, KeyError, AttributeError, TypeError, FileNotFoundError,
                 NotADirectoryError, FileExistsError, flags.Error)


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


def one_line(error: BaseException, argv: Sequence[str] = ()) -> str:
  """The error as one line; a config override that failed is named with its flag."""
  text = " ".join(str(error).split()).strip("'\"") or type(error).__name__
  if isinstance(error, (AttributeError, KeyError)):
    key = str(error).strip("'\" ").split("'")[0].split(" ")[0]
    names = [a.split("=")[0] for a in argv if a.startswith("--config.") and key and key in a]
    if names:
      return f"unknown config field in {', '.join(names)}: {text}"
  return f"{type(error).__name__}: {text}" if isinstance(error, (KeyError, TypeError)) else text


def _fail(error: BaseException, argv: Sequence[str]) -> None:
  print(f"error: {one_line(error, argv)}  (--verbose for the traceback)", file=sys.stderr)
  sys.exit(USAGE_EXIT)


def define_flags(config_help: str, default_config: str | None = None) -> Any:
  """Defines --config (a config file; ``default_config`` relative to the repository root),
  --dry_run and --verbose; returns the --config holder."""
  default = None if default_config is None else os.path.join(ROOT, default_config)
  holder = config_flags.DEFINE_config_file("config", default, config_help)
  flags.DEFINE_bool("dry_run", False, "Validate the config, mesh, lengths, paths and anchor (no "
                    "weights load), print it, then exit.")
  flags.DEFINE_bool("verbose", False, "Configuration errors with their traceback.")
  if default_config is None:
    flags.mark_flag_as_required("config")
  return holder


def run(config: Any, convert: Callable[[Any], Any], execute: Callable[[Any], Any],
        argv: Sequence[str] | None = None,
        check: Callable[[Any], list[str]] | None = preflight) -> None:
  """Parses the flags, converts and checks the config, then runs ``execute(cfg)``.

  Args:
    config: the holder `define_flags` returned.
    convert: ConfigDict -> the typed config (may read other flags, e.g. --workdir).
    execute: runs the command; a returned mapping is printed as JSON.
    argv: the command line (default ``sys.argv``).
    check: the checks before any weights load (returns notes; None for jobs that build their own
      tiny models).
  """
  argv = [resolve_config_arg(a) for a in (sys.argv if argv is None else argv)]
  # JAX logs at INFO which backends it could not open (e.g. libtpu on a GPU or CPU machine).
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  verbose = any(a in ("--verbose", "--verbose=true", "--verbose=True", "--verbose=1") for a in argv)
  running = []

  def main(args: Sequence[str]) -> None:
    if len(args) > 1:
      raise app.UsageError(f"unexpected arguments: {list(args[1:])}")
    if not verbose:
      absl_logging.set_verbosity(absl_logging.WARNING)  # orbax logs every save / restore at INFO
    cfg = convert(config.value)
    for note in check(cfg) if check is not None else []:
      print(note, file=sys.stderr)  # stdout stays JSON
    if flags.FLAGS.dry_run:
      print(json.dumps(config_lib.to_dict(cfg), indent=1, default=str))
      return
    running.append(True)
    result = execute(cfg)
    if result is not None:
      print(json.dumps(result, indent=1, default=str))

  try:
    app.run(main, argv=argv)
  except CONFIG_ERRORS as e:
    if verbose or running:
      raise
    _fail(e, argv)
