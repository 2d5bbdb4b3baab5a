"""The one ConfigDict -> typed-config conversion used by every command, on `disa_jax.codec`.

Every entry point reads an `ml_collections` config file and converts its ConfigDict once, with
`from_mapping`, into a tree of frozen dataclasses: the Stage 1 / 2 / 3 / evaluation / SFT workflow
configs, the main job's config and the Stage 3 `TrainConfig`. The conversion is `codec.decode`'s
walk over the fields' types, read as a config: it refuses unknown and missing fields, converts
lists to tuples, coerces ints to floats where a float is declared, refuses NaN and +-inf in every
float of every stage's config (typed fields, and the values of open sections such as
``engine.vllm_kwargs`` / ``jax_kwargs`` and a run's ``overrides``: `codec.refuse_nonfinite`; no
field gives infinity a meaning, and a range check written as a comparison lets NaN through:
``lr=inf`` and ``weight_decay=nan`` were accepted), and names the dotted field in every error; each dataclass then validates its own values in ``__post_init__``, so nothing downstream
re-checks them.

A field whose type defines ``from_config(value, where)`` (a classmethod) is built by it, and a
field typed as the base of a `codec` tagged union (the Stage 3 objective, `disa_jax.rl.objectives`)
is the subclass its ``name`` entry picks. `to_dict` is the inverse (JSON-ready), `codec.encode`:
a field declared with `disa_jax.codec.field`'s ``omit`` is left out while it holds that value (a
field added since, recorded only where set, so that the identity files of outputs written before
it existed still match).

A command's config derives from `Section`, whose ``from_config`` is its entry point.

`check_attention_chunk` is the one check of the ``attention_chunk`` field that the workflow
sections building a `Transformer` for long sequences carry (Stage 3 ``model``, the Stage 1 / 2
scorer, the SFT section, ``exact_target``); `Transformer` applies it to its argument too, and
`check_attention_impl` / `check_remat_policy` to the ``attention_impl`` / ``remat_policy`` fields
next to it.
"""
from __future__ import annotations

from typing import Any, Mapping, TypeVar

from disa_jax import codec

T = TypeVar("T")

__all__ = ["ATTENTION_IMPLS", "REMAT_POLICIES", "check_attention_chunk", "check_attention_impl",
           "check_remat_policy", "from_mapping", "qualify", "Section", "to_dict"]

qualify = codec.qualify

# `Transformer` attention implementations (`disa_jax.models.attention_dispatch`): 'auto' = 'dense'
# for rows of <= 256 tokens and 'xla' for longer ones on a CPU, 'cudnn' on a GPU, 'splash' on a TPU
# (each falling back to 'xla' for what it cannot run).
ATTENTION_IMPLS = ("auto", "dense", "xla", "pallas", "cudnn", "splash")
# What a rematerialised decoder layer keeps for the backward pass (`Transformer.remat_policy`).
REMAT_POLICIES = ("full", "save_attn", "save_qkv_attn", "save_qkv_attn_mlp")


def check_count(value: Any, field: str, zero: str = "") -> None:
  """Refuses a count that is not an int >= 0 (a bool is not one), naming ``field``, what 0 means
  (``zero``, if anything) and the value."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise ValueError(f"{field} must be an int >= 0{f' ({zero})' if zero else ''}, got {value!r}")


def check_attention_chunk(value: Any, field: str = "attention_chunk") -> None:
  """Refuses an attention query-block size that is not an int >= 0, naming ``field`` and the value.

  0 = no chunking (the implementation's own query blocks: block-sparse for 'xla', causal blocks of
  the `[T, T]` mask for 'dense'); c > 0 = queries in blocks of c tokens whose probabilities the
  backward pass recomputes (`disa_jax.models.attention_xla`), any row length.
  """
  check_count(value, field, "0 = no chunking, c > 0 = query blocks of c tokens")


def check_attention_impl(value: Any, field: str = "attention_impl") -> None:
  """Refuses an attention implementation not in `ATTENTION_IMPLS`, naming ``field`` and value."""
  if value not in ATTENTION_IMPLS:
    raise ValueError(f"{field} must be one of {ATTENTION_IMPLS}, got {value!r}")


def check_remat_policy(value: Any, field: str = "remat_policy") -> None:
  """Refuses a remat policy not in `REMAT_POLICIES`, naming ``field`` and the value."""
  if value not in REMAT_POLICIES:
    raise ValueError(f"{field} must be one of {REMAT_POLICIES}, got {value!r}")


def from_mapping(cls: type[T], data: Mapping[str, Any] | Any, where: str = "config") -> T:
  """Builds the frozen dataclass ``cls`` from ``data`` (`codec.decode` of a config section).

  Args:
    cls: a dataclass type or a `codec` tagged union's base (fields typed as dataclasses, ``tuple[...]``, ``dict``, ``X | None``,
      int / float / str / bool, a `codec` tagged union, or a type with a ``from_config``
      classmethod).
    data: a mapping or an `ml_collections.ConfigDict`.
    where: the dotted name of ``data`` used in error messages.

  Returns:
    The dataclass instance (its ``__post_init__`` validation runs as usual).

  Raises:
    ValueError: on an unknown field, a missing field without default, a value of the wrong kind
      or range, or a float field set to NaN or +-inf; the message names the dotted field.
  """
  return codec.read_config(cls, data, where)


class Section:
  """A command's config (a frozen dataclass deriving from this): `from_config` reads it."""

  @classmethod
  def from_config(cls: type[T], config: Any, where: str = "config") -> T:
    """From a ConfigDict / dict (`from_mapping`: unknown fields and bad values raise, naming the
    field); ``where``: the section's name when it is part of another (the N-study's ``stage1``)."""
    return from_mapping(cls, config, where)


def to_dict(obj: Any) -> Any:
  """A JSON-ready form of a config (`codec.encode`: tuples become lists, a tagged union's tag
  first, a field left out while it holds its `codec.field` ``omit`` value)."""
  return codec.encode(obj)
