"""Launch detection from SLURM / TPU / explicit environment variables (no processes started)."""
import os
import sys

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from disa_jax import testing
from disa_jax.parallel import distributed
from disa_jax.rollout import engines


@pytest.mark.parametrize("nodelist,first", [
    ("gpu[003-005,9],cpu1", "gpu003"), ("node7", "node7"), ("a-b[10,12]", "a-b10"),
    ("host01,host02", "host01")])
def test_first_slurm_host(nodelist, first):
  assert distributed.first_slurm_host(nodelist) == first


def test_detect_slurm_one_process_per_gpu():
  env = {"SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
         "SLURM_STEP_NODELIST": "gpu[010-011]", "DISA_COORDINATOR_PORT": "23456"}
  spec = distributed.detect_launch(env)
  assert spec == distributed.LaunchSpec("slurm", "gpu010:23456", 16, 9, 1, (1,))
  assert spec.is_distributed
  bound = dict(env, CUDA_VISIBLE_DEVICES="1")  # srun --gpus-per-task=1: the task sees one GPU
  assert distributed.detect_launch(bound).local_device_ids is None


def test_detect_slurm_one_process_per_host():
  env = {"SLURM_NTASKS": "4", "SLURM_NNODES": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
         "SLURM_JOB_NODELIST": "n[1-4]"}
  spec = distributed.detect_launch(env)
  assert spec == distributed.LaunchSpec("slurm", f"n1:{distributed.DEFAULT_PORT}", 4, 0, 0, None)
  env["DISA_LOCAL_DEVICE_IDS"] = "0,1,2,3,4,5"  # GPUs 6, 7 left to the generation process
  assert distributed.detect_launch(env).local_device_ids == (0, 1, 2, 3, 4, 5)


def test_detect_env_tpu_single_and_precedence():
  env = {"DISA_COORDINATOR": "10.0.0.1:1234", "DISA_NUM_PROCESSES": "3", "DISA_PROCESS_ID": "2",
         "DISA_LOCAL_DEVICE_IDS": "0,1", "SLURM_NTASKS": "9", "SLURM_PROCID": "1"}
  assert distributed.detect_launch(env) == distributed.LaunchSpec(
      "env", "10.0.0.1:1234", 3, 2, 0, (0, 1))
  assert distributed.detect_launch({"TPU_WORKER_HOSTNAMES": "t0,t1", "TPU_WORKER_ID": "1"}).source == "tpu"
  single = distributed.detect_launch({})
  assert single.source == "single" and not single.is_distributed


def test_bad_values_name_the_field():
  with pytest.raises(ValueError, match="DISA_PROCESS_ID='x'"):
    distributed.detect_launch({"DISA_COORDINATOR": "h:1", "DISA_NUM_PROCESSES": "2",
                               "DISA_PROCESS_ID": "x"})
  with pytest.raises(ValueError, match="process_id=5"):
    distributed.LaunchSpec("env", "h:1", 2, 5)


def test_generation_env():
  assert engines.generation_env({}) == {}
  assert engines.generation_env({"DISA_GENERATION_GPUS": "6, 7"}) == {
      "CUDA_VISIBLE_DEVICES": "6,7"}
  with pytest.raises(ValueError, match="DISA_GENERATION_GPUS='a'"):
    engines.generation_env({"DISA_GENERATION_GPUS": "a"})


def test_single_process_rows_and_batch():
  devices = np.asarray(jax.devices()[:4]).reshape(1, 4, 1)
  mesh = Mesh(devices, ("data", "fsdp", "tensor"))
  sharding = NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp")))
  x = np.arange(2 * 8 * 3).reshape(2, 8, 3)
  assert distributed.process_rows(sharding, x.shape, axis=1) == slice(0, 8)
  out = distributed.shard_global_batch({"x": x}, sharding, axis=1)["x"]
  assert out.sharding.is_equivalent_to(sharding, 3)
  np.testing.assert_array_equal(np.asarray(out), x)
  np.testing.assert_array_equal(distributed.replicate_to_hosts({"x": out})["x"], x)


def test_single_process_fast_path_equals_per_process_placement(monkeypatch):
  """One process: `shard_global_batch` puts the whole tree in one ``device_put`` and
  `replicate_to_hosts` fetches it in one ``device_get``; the arrays (values, dtypes, shardings,
  None leaves, a tree of shardings) are those of the per-leaf multi-process placement."""
  devices = np.asarray(jax.devices()[:4]).reshape(2, 2, 1)
  mesh = Mesh(devices, ("data", "fsdp", "tensor"))
  rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
  rep = NamedSharding(mesh, PartitionSpec())
  rng = np.random.default_rng(0)
  batch = {"ids": rng.integers(0, 50, (8, 5)), "lp": rng.normal(size=(8, 5)).astype(np.float32),
           "mask": rng.random((8, 5)) > 0.5, "none": None,
           "slot": rng.integers(0, 3, (6,)).astype(np.int32)}
  shardings = {"ids": rows, "lp": rows, "mask": rows, "none": rep, "slot": rep}
  with monkeypatch.context() as m:  # the fast path never places a leaf on its own
    m.setattr(distributed.jax, "make_array_from_process_local_data", None)
    fast_one = distributed.shard_global_batch(batch, shardings)
    fast_all = distributed.shard_global_batch({k: batch[k] for k in ("ids", "lp")}, rows)
    fast_host = distributed.replicate_to_hosts(fast_one)
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)  # the per-leaf placement
  slow_one = distributed.shard_global_batch(batch, shardings)
  slow_all = distributed.shard_global_batch({k: batch[k] for k in ("ids", "lp")}, rows)
  slow_host = distributed.replicate_to_hosts(slow_one)
  for fast, slow in ((fast_one, slow_one), (fast_all, slow_all)):
    assert jax.tree.structure(fast) == jax.tree.structure(slow)
    for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(slow)):
      assert a.dtype == b.dtype and a.shape == b.shape
      assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert fast_one["none"] is None and fast_host["none"] is None
  for k in ("ids", "lp", "mask", "slot"):
    a, b = fast_host[k], slow_host[k]
    assert isinstance(a, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def test_multihost_check_two_processes():
  """`launch/multihost.py --check` joins 2 processes (3 CPU devices each) and all-reduces."""
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
  port = testing.free_port()
  results = testing.run_processes(
      [([sys.executable, os.path.join(root, "launch", "multihost.py"), "--check"],
        dict(os.environ, DISA_COORDINATOR=f"localhost:{port}", DISA_NUM_PROCESSES="2",
             DISA_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=3")) for pid in range(2)],
      cwd=root, timeout=90)
  outs = [out for _, out in results]
  assert [rc for rc, _ in results] == [0, 0], outs
  for pid, out in enumerate(outs):
    assert f"process {pid}/2 launch=env local_devices=3 global_devices=6 all_reduce=21 OK" in out


def test_process_allgather_in_one_process_stacks_or_tiles():
  """The single-process branch keeps multihost_utils' shapes: stacked [1, ...] or tiled."""
  tree = {"a": np.arange(3, dtype=np.int32), "b": np.float32(2.5)}
  stacked = distributed.process_allgather(tree)
  assert stacked["a"].shape == (1, 3) and stacked["b"].shape == (1,)
  tiled = distributed.process_allgather(tree, tiled=True)
  np.testing.assert_array_equal(tiled["a"], tree["a"])
  assert tiled["b"] == np.float32(2.5)
  assert distributed.any_process(True) and not distributed.any_process(False)
  assert distributed.host_leaders() == [0]


def test_feed_hands_host_arrays_to_a_one_device_program_and_places_them_otherwise(monkeypatch):
  """`feed`: on one device of one process the batch stays on the host (the jitted program's call
  transfers it; no ``device_put``); a program over several devices, or several processes, get
  `shard_global_batch`'s global arrays."""
  batch = {"ids": np.arange(8 * 3).reshape(8, 3), "none": None}
  one = NamedSharding(Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1),
                           ("data", "fsdp", "tensor")), PartitionSpec(("data", "fsdp")))
  two = NamedSharding(Mesh(np.asarray(jax.devices()[:2]).reshape(1, 2, 1),
                           ("data", "fsdp", "tensor")), PartitionSpec(("data", "fsdp")))
  with monkeypatch.context() as m:
    m.setattr(distributed.jax, "device_put", None)  # never called on one device
    host = distributed.feed(batch, {"ids": one, "none": one})
  assert isinstance(host["ids"], np.ndarray) and host["none"] is None
  placed = distributed.feed(batch, two)
  assert isinstance(placed["ids"], jax.Array) and placed["ids"].sharding.is_equivalent_to(two, 2)
  monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
  assert isinstance(distributed.feed(batch, one)["ids"], jax.Array)
  monkeypatch.undo()
  out = jax.jit(lambda x: x * 2, in_shardings=one)(host["ids"])  # placed by the program's call
  assert out.sharding.is_equivalent_to(one, 2)
  np.testing.assert_array_equal(np.asarray(out), batch["ids"] * 2)
