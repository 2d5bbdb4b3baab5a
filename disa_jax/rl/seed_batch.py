"""Several Stage 3 seeds of one run trained together: the seeds as one batch dimension.

S seeds of a run (one config, differing only in ``train.seed``, the tracker's seed and the run
directory) each run today's code path, `run_stage3` and its `Trainer` loop, in a thread of their
own in one process. The device calls that carry a step's work go through one `SeedBatcher`:

- the rollout engine's generation programs (`JaxSampler`; the exact tracker samples through it too),
- the scorer's passes (pi_ref, pi_old, the anchor's prompt embeddings),
- the update's micro step (forward / backward / accumulate) and optimizer step.

A routed call waits until every live seed waits on one; then the waiting calls of one role and one
argument shape run as ONE jitted ``jax.vmap`` over the seeds (inputs stacked, outputs split, in the
same program), compiled once per shape for all S seeds (the PureJaxRL way: parameters, optimizer
states, keys and batches of the seeds stacked on a leading axis). Everything else (grading,
packing, metrics, checkpoints, the export) is each seed's own code on the host, unchanged, so a
seed's metrics.jsonl, checkpoints and export sit in its own run directory as a lone run's do.

Exactness. A group is always run at the batch's full width S (missing seeds padded with a copy of
the first one's inputs, results dropped), so every seed's lane runs the same program whatever the
other seeds do: seeds whose micro-batch counts differ, or that resume from different steps, still
compute their own results. A vmapped program rounds its float32 sums in another order than the
unbatched one, so a seed of a batch equals that seed trained alone to float tolerance
(tests/rl/test_seed_batch.py). With S = 1 nothing is routed: the run is today's, bit for bit.

What is not batched: a function whose closure differs per seed cannot share one program; the
update's micro step of an objective with trainable state (FlowRL's head draws dropout keys from a
per-seed ``key_seed``) runs per seed, its optimizer step, the scorer and the sampler still batched.
An engine other than the in-process `JaxSampler` samples per seed.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Any, Callable, Iterator, Sequence, TypeVar

import jax
import jax.numpy as jnp

from disa_jax import config as config_lib
from disa_jax import preemption
from disa_jax.checkpoint.identity import flatten
from disa_jax.rl import trainer as trainer_lib
from disa_jax.rollout.jax_sampler import JaxSampler

T = TypeVar("T")


@dataclasses.dataclass
class _Call:
  """One seed's routed call, waiting for its group to run."""
  role: str
  raw: Callable
  static: tuple[tuple[int, Any], ...]
  leaves: list[Any]
  treedef: Any
  result: Any = None
  error: BaseException | None = None
  done: bool = False

  def key(self) -> tuple:
    """The group's key: calls of one role, static arguments and argument shapes share a program."""
    avals = tuple((jnp.shape(x), jnp.result_type(x)) for x in self.leaves)
    return (self.role, self.static, self.treedef, avals)


def _bind_static(raw: Callable, static: tuple[tuple[int, Any], ...], num_args: int) -> Callable:
  """``raw`` with its static positional arguments filled in: a function of the dynamic ones."""
  if not static:
    return raw
  fixed = dict(static)

  def bound(*dyn, **kwargs):
    it = iter(dyn)
    return raw(*(fixed[i] if i in fixed else next(it) for i in range(num_args)), **kwargs)

  return bound


class SeedBatcher:
  """Runs the routed device calls of S seed threads as one vmapped call (see the module docstring).

  Args:
    size: S, the seeds trained together (the width of every batched program).
  """

  def __init__(self, size: int):
    if not (isinstance(size, int) and size >= 1):
      raise ValueError(f"SeedBatcher size must be an int >= 1, got {size!r}")
    self.size = size
    self._cv = threading.Condition()
    self._members: set[int] = set()
    self._waiting: dict[int, _Call] = {}
    self._programs: dict[tuple, Callable] = {}
    self.roles: collections.Counter[str] = collections.Counter()  # groups run, by role
    self._joined = 0  # members so far: nothing fires before all `size` have joined

  @contextlib.contextmanager
  def member(self) -> Iterator[None]:
    """The calling thread is one seed of the batch for the duration: its routed calls wait for the
    other members' (a member that leaves, finished or failed, no longer holds the others up)."""
    me = threading.get_ident()
    with self._cv:
      if len(self._members) >= self.size:
        raise RuntimeError(f"SeedBatcher of size {self.size} already has {self.size} members")
      self._members.add(me)
      self._joined += 1
    try:
      yield
    finally:
      with self._cv:
        self._members.discard(me)
        self._fire_if_ready()

  def route(self, fn: Callable, role: str, static_argnums: tuple[int, ...] = ()) -> Callable:
    """``fn`` (a ``jax.jit`` function) as a routed call of ``role``: the same result for a
    thread that is not a member, else one lane of the group's vmapped program.

    Args:
      fn: the jitted function (its ``__wrapped__`` is what the batch vmaps; its donation is not
        kept: the stacked inputs are copies).
      role: what it computes; calls of one role and argument shape share a program, so the
        function must be the same computation in every seed (no per-seed closure constants).
      static_argnums: ``fn``'s static positional arguments (part of the group's key).

    Returns:
      The routed function (``fn`` itself for a batch of one seed).
    """
    if self.size == 1:
      return fn
    raw = getattr(fn, "__wrapped__", None)
    if raw is None:
      raise TypeError(f"SeedBatcher.route({role!r}) needs a jax.jit function (with "
                      f"__wrapped__), got {type(fn).__name__}")

    def routed(*args, **kwargs):
      if threading.get_ident() not in self._members:
        return fn(*args, **kwargs)
      static = tuple((i, args[i]) for i in static_argnums)
      dyn = [a for i, a in enumerate(args) if i not in static_argnums]
      leaves, treedef = jax.tree.flatten((tuple(dyn), kwargs))
      bound = _bind_static(raw, static, len(args))
      return self._submit(_Call(role, bound, static, leaves, treedef))

    routed.__wrapped__ = raw
    return routed

  def programs(self) -> int:
    """The batched programs built so far (one per role, static arguments and shapes)."""
    return len(self._programs)

  def _submit(self, call: _Call) -> Any:
    with self._cv:
      self._waiting[threading.get_ident()] = call
      self._fire_if_ready()
      while not call.done:
        self._cv.wait()
    if call.error is not None:
      raise call.error
    return call.result

  def _fire_if_ready(self) -> None:
    """With the lock held: once every member waits, runs the waiting calls (one program per
    group)."""
    if (not self._waiting or len(self._waiting) < len(self._members)
        or self._joined < self.size):  # a seed that started early waits for the others
      return
    calls, self._waiting = list(self._waiting.values()), {}
    groups: dict[tuple, list[_Call]] = {}
    for c in calls:
      groups.setdefault(c.key(), []).append(c)
    for members in groups.values():
      self._run_group(members)
    self._cv.notify_all()

  def _run_group(self, calls: list[_Call]) -> None:
    try:
      key = calls[0].key()
      if key not in self._programs:
        self._programs[key] = _program(calls[0].raw, calls[0].treedef)
      lanes = [c.leaves for c in calls]
      lanes += [lanes[0]] * (self.size - len(calls))  # padding: the first seed's inputs again
      outs = self._programs[key](lanes)
      self.roles[calls[0].role] += 1
      for c, out in zip(calls, outs):
        c.result = out
    except Exception as e:  # pylint: disable=broad-except
      for c in calls:
        c.error = e
    for c in calls:
      c.done = True


def _program(raw: Callable, treedef: Any) -> Callable:
  """``jit([S][leaves] -> [S] outputs)``: every lane's argument leaves stacked on a new leading
  axis, ``raw`` vmapped over it, the outputs split back into one tree per lane (one program)."""

  def run(lanes):
    stacked = [jnp.stack([lane[j] for lane in lanes]) for j in range(len(lanes[0]))]

    def one(*leaves):
      args, kwargs = jax.tree.unflatten(treedef, leaves)
      return raw(*args, **kwargs)

    out = jax.vmap(one)(*stacked)
    return [jax.tree.map(lambda x, i=i: x[i], out) for i in range(len(lanes))]

  return jax.jit(run)


# -- routing a Stage 3 run's parts ---------------------------------------------------------------


def route_sampler(engine: Any, batcher: SeedBatcher) -> bool:
  """Routes an in-process `JaxSampler`'s generation programs (one role per program key: the
  decode path and its static shapes); returns False (nothing routed) for another engine."""
  if not isinstance(engine, JaxSampler):
    return False
  make = engine._fn  # pylint: disable=protected-access
  routed: dict[tuple, Callable] = {}

  def routed_fn(key: tuple) -> Callable:
    if key not in routed:
      routed[key] = batcher.route(make(key), f"sampler{key}")
    return routed[key]

  engine._fn = routed_fn  # pylint: disable=protected-access
  return True


def route_trainer(trainer: Any, batcher: SeedBatcher) -> None:
  """Routes a built `Trainer`'s device calls through ``batcher``: its engine's generation, its
  scorer's passes and its update's micro and optimizer steps (the micro step only for an objective
  without trainable state: see the module docstring)."""
  # pylint: disable=protected-access
  updater, scorer = trainer.parts.updater, trainer.parts.scorer
  step = updater._step
  if not trainer.cfg.objective.has_state:
    step._micro_j = batcher.route(step._micro_j, "update.micro")
  step._finish_j = batcher.route(step._finish_j, "update.finish")
  scorer._score_policy = batcher.route(scorer._score_policy, "score.policy")
  if hasattr(scorer, "_score_ref"):  # (an objective with the reference or an anchor)
    scorer._score_ref = batcher.route(scorer._score_ref, "score.reference")
    scorer._embed = batcher.route(scorer._embed, "score.embed", static_argnums=(2,))
  route_sampler(updater.link.engine, batcher)


def _same_run(trainer: Any) -> dict[str, Any]:
  """What every seed of a batch must share, flattened (``{'train.optim.lr': ..., 'param_shapes.
  <path>': ...}``): its train config but the seed (and the progress bar) and its policy's
  parameter shapes."""
  cfg = config_lib.to_dict(trainer.cfg)
  return flatten("", {"train": {k: v for k, v in cfg.items() if k not in ("seed", "progress_bar")},
                      "param_shapes": trainer.parts.updater.param_shapes()})


class _Router:
  """The build hook of a batch's threads: routes each seed's `Trainer` once it is built, after
  checking that it is the same run as the first seed's (a routed program computes every lane with
  one seed's functions)."""

  def __init__(self, batcher: SeedBatcher):
    self.batcher, self._first = batcher, None
    self._lock = threading.Lock()

  def __call__(self, trainer: Any) -> None:
    if self.batcher.size > 1 and trainer.cfg.checkpoint.async_save:
      raise ValueError(f"{trainer.workdir}: train.checkpoint.async_save must be False for seeds "
                       "trained together (orbax's asynchronous writes from several threads at "
                       "once collide)")
    run = _same_run(trainer)
    with self._lock:
      if self._first is None:
        self._first = (trainer.workdir, run)
      workdir, first = self._first
    diff = sorted(k for k in set(first) | set(run) if first.get(k) != run.get(k))
    if diff:
      raise ValueError(f"the seeds trained together must be one run but for their seed: "
                       f"{trainer.workdir} has {diff[0][1:]}={run.get(diff[0])!r}, {workdir} has "
                       f"{first.get(diff[0])!r}")
    route_trainer(trainer, self.batcher)


def train_together(runs: Sequence[Callable[[], T]], batcher: SeedBatcher | None = None
                   ) -> list[T]:
  """Runs each of ``runs`` (a seed's Stage 3 run, e.g. ``functools.partial(run_stage3, cfg)``) in
  a thread of its own as a member of one `SeedBatcher`: each `Trainer` they build is routed through
  it (`route_trainer`). Call from the main thread: it holds the preemption signals' context
  (`disa_jax.preemption.watch`) that the seeds' stages nest in, so a SIGTERM stops every seed at
  its next step boundary with a checkpoint.

  Args:
    runs: S callables, the seeds of one run (the same config but the seed: checked per trainer).
    batcher: the `SeedBatcher` of size S to use (default: a new one).

  Returns:
    Their results, in order.

  Raises:
    RuntimeError: naming every seed that failed (after the others finish), from the first error.
  """
  if not runs:
    raise ValueError("train_together needs at least one run, got none")
  batcher = batcher or SeedBatcher(len(runs))
  if batcher.size != len(runs):
    raise ValueError(f"train_together: a batcher of size {batcher.size} for {len(runs)} runs")
  router = _Router(batcher)
  results: list[Any] = [None] * len(runs)
  errors: dict[int, BaseException] = {}

  def work(i: int) -> None:
    with batcher.member():
      trainer_lib.BUILD_HOOK.fn = router
      try:
        results[i] = runs[i]()
      except BaseException as e:  # pylint: disable=broad-except
        errors[i] = e
      finally:
        trainer_lib.BUILD_HOOK.fn = None

  with preemption.watch():
    threads = [threading.Thread(target=work, args=(i,), name=f"seed-batch-{i}")
               for i in range(len(runs))]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  if errors:
    raise RuntimeError(f"seeds {sorted(errors)} of the batch failed: "
                       f"{ {i: repr(e) for i, e in sorted(errors.items())} }"
                       ) from errors[min(errors)]
  return results
