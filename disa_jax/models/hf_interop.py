"""Hugging Face checkpoint interop: a declarative key table, state-dict exchange, load and save.

Every HF tensor name is described once in `KEY_TABLE`: its name template, our parameter path, its HF
shape as a function of the config, and whether the HF matrix is the transpose of ours. Import and
export both walk this table, so a checkpoint that loads also round-trips. Loading uses every tensor
and asserts every shape; anything missing, unexpected or misshapen is an error naming the key.

Our layouts: linear kernels are `[in, out...]` with heads split out (`q_kernel [D, N, H]`,
`o_kernel [N, H, D]`); HF's are `[out, in]` with heads flattened. Layer parameters are stacked
`[L, ...]`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from disa_jax.models.config import ModelConfig
from disa_jax.models.transformer import ModelOptions, Transformer
from disa_jax.parallel.distributed import replicate_to_hosts
from disa_jax.parallel.rules import TRAIN_RULES, Rules, ShardingContext, param_sharding, say_fallbacks

ShapeFn = Callable[[ModelConfig], tuple[int, ...]]


def _always(c: ModelConfig) -> bool:
  del c
  return True


@dataclasses.dataclass(frozen=True)
class KeyRule:
  """One HF tensor family.

  Attributes:
    hf_name: HF tensor name; `{layer}` stands for the layer index.
    path: our parameter: 'embed' | 'final_norm' | 'lm_head' | 'layers.<name>'.
    hf_shape: the HF tensor's shape for a config.
    transpose: whether ours = hf.T reshaped (linear kernels) rather than hf reshaped.
    when: whether the tensor exists for a config.
  """

  hf_name: str
  path: str
  hf_shape: ShapeFn
  transpose: bool
  when: Callable[[ModelConfig], bool] = _always

  @property
  def per_layer(self) -> bool:
    return "{layer}" in self.hf_name

  @property
  def pattern(self) -> re.Pattern[str]:
    return re.compile(re.escape(self.hf_name).replace(r"\{layer\}", r"(\d+)") + "$")


_ATTN = "model.layers.{layer}.self_attn."
_MLP = "model.layers.{layer}.mlp."

KEY_TABLE: tuple[KeyRule, ...] = (
    KeyRule("model.embed_tokens.weight", "embed", lambda c: (c.vocab_size, c.hidden_size), False),
    KeyRule("model.norm.weight", "final_norm", lambda c: (c.hidden_size,), False),
    KeyRule("lm_head.weight", "lm_head", lambda c: (c.vocab_size, c.hidden_size), True,
            lambda c: not c.tie_word_embeddings),
    KeyRule("model.layers.{layer}.input_layernorm.weight", "layers.attn_norm",
            lambda c: (c.hidden_size,), False),
    KeyRule(_ATTN + "q_proj.weight", "layers.q_kernel",
            lambda c: (c.num_heads * c.head_dim, c.hidden_size), True),
    KeyRule(_ATTN + "k_proj.weight", "layers.k_kernel",
            lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), True),
    KeyRule(_ATTN + "v_proj.weight", "layers.v_kernel",
            lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), True),
    KeyRule(_ATTN + "o_proj.weight", "layers.o_kernel",
            lambda c: (c.hidden_size, c.num_heads * c.head_dim), True),
    KeyRule(_ATTN + "q_proj.bias", "layers.q_bias", lambda c: (c.num_heads * c.head_dim,), False,
            lambda c: c.qkv_bias),
    KeyRule(_ATTN + "k_proj.bias", "layers.k_bias", lambda c: (c.num_kv_heads * c.head_dim,), False,
            lambda c: c.qkv_bias),
    KeyRule(_ATTN + "v_proj.bias", "layers.v_bias", lambda c: (c.num_kv_heads * c.head_dim,), False,
            lambda c: c.qkv_bias),
    KeyRule(_ATTN + "o_proj.bias", "layers.o_bias", lambda c: (c.hidden_size,), False,
            lambda c: c.o_bias),
    KeyRule(_ATTN + "q_norm.weight", "layers.q_norm", lambda c: (c.head_dim,), False,
            lambda c: c.qk_norm),
    KeyRule(_ATTN + "k_norm.weight", "layers.k_norm", lambda c: (c.head_dim,), False,
            lambda c: c.qk_norm),
    KeyRule("model.layers.{layer}.post_attention_layernorm.weight", "layers.mlp_norm",
            lambda c: (c.hidden_size,), False),
    KeyRule(_MLP + "gate_proj.weight", "layers.gate_kernel",
            lambda c: (c.intermediate_size, c.hidden_size), True),
    KeyRule(_MLP + "up_proj.weight", "layers.up_kernel",
            lambda c: (c.intermediate_size, c.hidden_size), True),
    KeyRule(_MLP + "down_proj.weight", "layers.down_kernel",
            lambda c: (c.hidden_size, c.intermediate_size), True),
)

_TIED_HEAD = "lm_head.weight"


def _rules_for(config: ModelConfig) -> list[KeyRule]:
  return [r for r in KEY_TABLE if r.when(config)]


def expected_hf_keys(config: ModelConfig) -> dict[str, tuple[KeyRule, int | None]]:
  """Every HF tensor name a checkpoint of `config` has -> (its rule, its layer index or None)."""
  out: dict[str, tuple[KeyRule, int | None]] = {}
  for rule in _rules_for(config):
    if rule.per_layer:
      for i in range(config.num_layers):
        out[rule.hf_name.format(layer=i)] = (rule, i)
    else:
      out[rule.hf_name] = (rule, None)
  return out


def _get_variable(model: Transformer, path: str) -> nnx.Variable:
  obj: Any = model
  for part in path.split("."):
    obj = getattr(obj, part)
  if not isinstance(obj, nnx.Variable):
    raise ValueError(f"model has no parameter at {path!r}")
  return obj


def _to_ours(rule: KeyRule, hf: np.ndarray, our_shape: tuple[int, ...]) -> np.ndarray:
  """HF layout -> our (per-layer) layout."""
  return (hf.T if rule.transpose else hf).reshape(our_shape)  # [out, in] -> [in, out...]


def _to_hf(rule: KeyRule, ours: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
  """Our (per-layer) layout -> HF layout (contiguous)."""
  if rule.transpose:
    return np.ascontiguousarray(ours.reshape(hf_shape[::-1]).T)  # [in, out...] -> [out, in]
  return np.ascontiguousarray(ours.reshape(hf_shape))


def _dtype_class(dtype: Any) -> str:
  """'float' (bfloat16 included), 'complex', 'int' (signed or not), 'bool' or the numpy kind."""
  dtype = jnp.dtype(dtype)
  for cls, name in ((jnp.floating, "float"), (jnp.complexfloating, "complex"),
                    (jnp.integer, "int"), (jnp.bool_, "bool")):
    if jnp.issubdtype(dtype, cls):
      return name
  return dtype.kind


def np_dtype(dtype: Any) -> np.dtype:
  """The NumPy dtype of a JAX dtype (bfloat16: ml_dtypes')."""
  return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(dtype)


# ------------------------------------------------------------------------------------------------
# state-dict exchange
# ------------------------------------------------------------------------------------------------


def to_hf_state_dict(model: Transformer, dtype: Any = None) -> dict[str, np.ndarray]:
  """All weights under their HF names in HF layouts (host numpy arrays).

  Args:
    model: the model (parameters may be sharded; they are gathered to host).
    dtype: output dtype (default: the parameters' dtype; bfloat16 uses `ml_dtypes.bfloat16`).

  Returns:
    `{hf_name: np.ndarray}` — exactly the keys `expected_hf_keys(model.config)` names.
  """
  c = model.config
  out: dict[str, np.ndarray] = {}
  for rule in _rules_for(c):
    host = np.asarray(jax.device_get(_get_variable(model, rule.path)[...]))
    if dtype is not None:
      host = host.astype(np_dtype(dtype))
    hf_shape = rule.hf_shape(c)
    if rule.per_layer:
      for i in range(c.num_layers):
        out[rule.hf_name.format(layer=i)] = _to_hf(rule, host[i], hf_shape)
    else:
      out[rule.hf_name] = _to_hf(rule, host, hf_shape)
  return out


def host_state_dict(model: Transformer, dtype: Any = None) -> dict[str, np.ndarray]:
  """The model's weights in HF names and layouts, complete on every process.

  Collective: every process must call it. The host leader then pushes the result into its local
  generation process (``engine.update_weights``, `disa_jax.rollout.multihost.push_weights`).

  Args:
    model: a `Transformer` whose parameters may be sharded across processes.
    dtype: optional dtype of the exported arrays (as `to_hf_state_dict`).
  """
  kwargs = {} if dtype is None else {"dtype": dtype}
  if jax.process_count() == 1:  # every shard is addressable: export directly
    return to_hf_state_dict(model, **kwargs)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  local = nnx.merge(graphdef, replicate_to_hosts(params), rest)  # NumPy leaves: a host copy
  local.sharding = None
  return to_hf_state_dict(local, **kwargs)


def _check_keys(config: ModelConfig, keys: set[str], tied_head: Callable[[], np.ndarray] | None,
                embed: Callable[[], np.ndarray]) -> None:
  expected = expected_hf_keys(config)
  missing = sorted(set(expected) - keys)
  if missing:
    raise ValueError(f"checkpoint is missing {len(missing)} tensors, first: {missing[:5]}")
  unexpected = sorted(keys - set(expected))
  if config.tie_word_embeddings and _TIED_HEAD in unexpected:
    # A tied checkpoint may still store lm_head.weight; accept it only if it is the embedding.
    if tied_head is None or not np.array_equal(np.asarray(tied_head()), np.asarray(embed())):
      raise ValueError("tie_word_embeddings=True but 'lm_head.weight' differs from "
                       "'model.embed_tokens.weight'")
    unexpected.remove(_TIED_HEAD)
  if unexpected:
    raise ValueError(f"checkpoint has {len(unexpected)} tensors this model does not use, first: "
                     f"{unexpected[:5]}")


def _assemble(config: ModelConfig, rule: KeyRule, our_shape: tuple[int, ...],
              get: Callable[[str], np.ndarray], dtype: np.dtype) -> np.ndarray:
  """Our full (stacked for layers) host array for `rule`, shape-checked, in `dtype`."""
  hf_shape = rule.hf_shape(config)

  want = _dtype_class(dtype)

  def one(name: str, shape: tuple[int, ...]) -> np.ndarray:
    hf = get(name)
    if tuple(hf.shape) != hf_shape:
      raise ValueError(f"tensor {name!r} has shape {tuple(hf.shape)}, expected {hf_shape}")
    if _dtype_class(hf.dtype) != want:  # an int tensor cast to float loads silently wrong values
      raise ValueError(f"tensor {name!r} has dtype {hf.dtype} ({_dtype_class(hf.dtype)}), expected "
                       f"a {want} dtype like the model's {np.dtype(dtype)}")
    return _to_ours(rule, hf, shape).astype(dtype)

  if not rule.per_layer:
    return one(rule.hf_name, our_shape)
  out = np.empty(our_shape, dtype)
  for i in range(config.num_layers):
    out[i] = one(rule.hf_name.format(layer=i), our_shape[1:])
  return out


def load_hf_state_dict(model: Transformer, state_dict: Mapping[str, Any]) -> None:
  """Loads HF-named, HF-layout weights into `model` in place.

  Every key must be used and every shape and dtype class (float / int / bool) must match
  (ValueError naming the key and dtype otherwise). Each parameter keeps its dtype and its current
  sharding.
  """
  c = model.config
  _check_keys(c, set(state_dict),
              (lambda: state_dict[_TIED_HEAD]) if _TIED_HEAD in state_dict else None,
              lambda: state_dict["model.embed_tokens.weight"])
  for rule in _rules_for(c):
    var = _get_variable(model, rule.path)
    current = var[...]
    host = _assemble(c, rule, tuple(current.shape), lambda k: np.asarray(state_dict[k]),
                     np_dtype(current.dtype))
    # Keep the array's committedness: jit caches executables per committed/uncommitted inputs, so a
    # committed replacement of an uncommitted parameter would force a recompilation after every load.
    if getattr(current, "committed", True):
      var.set_value(jax.device_put(host, current.sharding))
    else:
      var.set_value(jnp.asarray(host))


# ------------------------------------------------------------------------------------------------
# directories
# ------------------------------------------------------------------------------------------------


class _SafetensorsDir:
  """Lazy reader over a directory's safetensors file(s) (single file or sharded index)."""

  def __init__(self, path: str):
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
      with open(index) as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    elif os.path.exists(single):
      weight_map = {}
      with safe_open(single, framework="np") as f:
        for k in f.keys():
          weight_map[k] = "model.safetensors"
    else:
      raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    self.path = path
    self.weight_map = weight_map
    self._handles: dict[str, Any] = {}

  def keys(self) -> set[str]:
    return set(self.weight_map)

  def get(self, key: str) -> np.ndarray:
    fname = self.weight_map[key]
    if fname not in self._handles:
      self._handles[fname] = safe_open(os.path.join(self.path, fname), framework="np")
    return self._handles[fname].get_tensor(key)

  def iter_files(self) -> Iterator[str]:
    yield from sorted(set(self.weight_map.values()))


def read_checkpoint_tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a local HF checkpoint directory as stored (one `model.safetensors`, or the
  shards its index lists), keyed by HF name: to compare two exports tensor by tensor."""
  reader = _SafetensorsDir(path)
  return {k: reader.get(k) for k in sorted(reader.keys())}


def load_config(path: str) -> ModelConfig:
  """`ModelConfig` from `path/config.json`."""
  with open(os.path.join(path, "config.json")) as f:
    return ModelConfig.from_hf_config(json.load(f))


def from_pretrained(path: str, *, dtype: Any = jnp.float32, mesh: jax.sharding.Mesh | None = None,
                    rules: Rules | None = None, **model_kwargs: Any) -> Transformer:
  """Loads a local HF checkpoint directory (config.json + safetensors).

  Args:
    path: directory with config.json and model.safetensors or model.safetensors.index.json.
    dtype: parameter and computation dtype.
    mesh: when given, each weight is placed straight onto its sharding (one host copy of one
      parameter at a time; each device receives only its shard) and the model gets a
      `ShardingContext` for its activations.
    rules: logical->mesh rules (default `TRAIN_RULES`); only used with a mesh.
    **model_kwargs: the `ModelOptions` of the model (remat, layer loop, attention, ...).

  Returns:
    The model with every checkpoint tensor loaded.
  """
  config = load_config(path)
  reader = _SafetensorsDir(path)
  _check_keys(config, reader.keys(),
              (lambda: reader.get(_TIED_HEAD)) if _TIED_HEAD in reader.keys() else None,
              lambda: reader.get("model.embed_tokens.weight"))
  rules = TRAIN_RULES if rules is None else rules
  options = ModelOptions(**model_kwargs)
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype,
                                             param_dtype=dtype, options=options))
  host_dtype = np_dtype(dtype)
  fallbacks = []
  for rule in _rules_for(config):
    var = _get_variable(model, rule.path)
    shape = tuple(var.get_value().shape)
    host = _assemble(config, rule, shape, reader.get, host_dtype)
    if mesh is None:
      var.set_value(jnp.asarray(host))
    else:
      sharding, fell_back = param_sharding(var.get_metadata()["logical_axes"], shape, mesh, rules)
      if fell_back:
        fallbacks.append(f"{rule.path}: {sharding.spec}")
      var.set_value(jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx]))
    del host
  if mesh is not None:
    say_fallbacks(fallbacks, mesh)
    model.sharding = ShardingContext(mesh, rules)
  return model


def _save_shards(state: dict[str, np.ndarray], path: str, max_shard_bytes: int) -> None:
  """``state`` as safetensors shards of at most ``max_shard_bytes`` plus their index json."""
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, value in state.items():
    if shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = value
    size += value.nbytes
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, fname))
  index = {"metadata": {"total_size": int(sum(v.nbytes for v in state.values()))},
           "weight_map": weight_map}
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump(index, f, indent=2)


def save_pretrained(model: Transformer, path: str, *, dtype: Any = None,
                    max_shard_bytes: int = 0) -> str:
  """Writes `config.json` and the weights (numpy safetensors, no torch) into `path`.

  Args:
    model: the model.
    path: output directory (created).
    dtype: storage dtype (default: the parameters' dtype).
    max_shard_bytes: 0 = one `model.safetensors`; > 0 = shards ``model-0000i-of-0000n.safetensors``
      of at most this many bytes each (a tensor larger than that gets a shard of its own) and
      ``model.safetensors.index.json`` mapping every tensor to its shard (HF's sharded layout).

  Returns:
    `path`.
  """
  os.makedirs(path, exist_ok=True)
  state = to_hf_state_dict(model, dtype)
  stored = jnp.dtype(next(iter(state.values())).dtype if dtype is None else dtype)
  dtype_name = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16",
                jnp.dtype(jnp.float32): "float32"}.get(stored)
  if dtype_name is None:
    raise ValueError(f"save_pretrained: unsupported storage dtype {stored}")
  if max_shard_bytes < 0:
    raise ValueError(f"save_pretrained: max_shard_bytes must be >= 0, got {max_shard_bytes}")
  if max_shard_bytes:
    _save_shards(state, path, max_shard_bytes)
  else:
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(model.config.to_hf_config(dtype_name), f, indent=2)
  return path
