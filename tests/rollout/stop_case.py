"""The stop-id case shared by the engine tests: a tokenizer whose eos differs from its
`generation_config.json`'s, and generation that must stop at the generation config's eos.

The tiny models are random, so the generation config's eos is chosen from what the engine samples:
a first run without stop ids picks a token that prompt 0's sample emits at position >= 2 and not
before (and that is not the tokenizer's eos); that token becomes `generation_config.json`'s
eos_token_id. The second run, with the same seed and `stop_token_ids(...)`, must give every sample
of the first run cut at its first stop id (inclusive), so prompt 0 stops at that token.
"""
import dataclasses
import json
import os

from transformers import AutoTokenizer

from disa_jax import testing
from disa_jax.rollout import SamplingParams
from disa_jax.rollout.stop_ids import stop_token_ids

PROMPTS = [[1, 5, 6, 7], [1, 9], [1, 20, 30, 40, 50, 60, 70]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)


def write_tokenizer_dir(path: str, generation_eos) -> AutoTokenizer:
  """The tiny tokenizer (eos `<|im_end|>` = 2) and a generation config with ``generation_eos``."""
  os.makedirs(path, exist_ok=True)
  testing.make_tokenizer().save_pretrained(path)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": generation_eos, "bos_token_id": 1}, f)
  return AutoTokenizer.from_pretrained(path)


def pick_generation_eos(first, tokenizer_eos: int) -> int:
  ids = first[0][0].token_ids.tolist()
  for k in range(2, len(ids)):
    if ids[k] not in ids[:k] and ids[k] != tokenizer_eos:
      return int(ids[k])
  raise AssertionError(f"no usable token in {ids}")


def check_engine_stops_at_generation_config_eos(engine, tmp_dir: str) -> tuple[int, ...]:
  """Runs the case on ``engine``; returns the stop ids used."""
  first = engine.generate(PROMPTS, PARAMS)
  eos = testing.make_tokenizer().eos_token_id
  gen_eos = pick_generation_eos(first, eos)
  tok = write_tokenizer_dir(tmp_dir, [gen_eos])
  stops = stop_token_ids(tok, tmp_dir, chat_template=True)
  assert tok.eos_token_id == eos != gen_eos and gen_eos in stops, (stops, gen_eos)
  second = engine.generate(PROMPTS, dataclasses.replace(PARAMS, stop_token_ids=stops))
  for per_first, per_second in zip(first, second):
    for a, b in zip(per_first, per_second):
      ids = a.token_ids.tolist()
      cut = next((i + 1 for i, t in enumerate(ids) if t in stops), len(ids))
      assert b.token_ids.tolist() == ids[:cut]
      assert b.finish_reason == ("stop" if ids[cut - 1] in stops else "length")
  c = second[0][0]
  assert c.finish_reason == "stop" and int(c.token_ids[-1]) == gen_eos
  return stops
