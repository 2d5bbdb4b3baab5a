"""`MetricsLogger`'s TensorBoard events: one event per step holding every finite scalar of the row
(not one event per metric), at the row's step, and a resume's purge marker before the recomputed
steps. The event files are read back as TensorBoard reads them (TFRecord framing, `Event` protos)."""
import glob
import os
import struct

from disa_jax.rl.metrics import MetricsLogger


def _events(tb_dir):
  """Every `Event` of the event files under ``tb_dir``, file by file in creation order."""
  from tensorboardX.proto.event_pb2 import Event  # pylint: disable=g-import-not-at-top
  out = []
  for path in sorted(glob.glob(os.path.join(tb_dir, "events.out.tfevents.*")),
                     key=lambda p: (os.path.getmtime(p), p)):
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = Event()
      event.ParseFromString(data[pos + 12:pos + 12 + length])
      out.append(event)
      pos += 12 + length + 4
  return out


def _scalars(events):
  return [(e.step, {v.tag: v.simple_value for v in e.summary.value})
          for e in events if e.summary.value]


def test_each_step_is_one_event_with_its_finite_scalars(tmp_path):
  with MetricsLogger(str(tmp_path)) as log:
    log.write(1, {"loss": 0.5, "reward": 0.25, "kl": float("nan")})
    log.write(2, {"loss": 0.75, "reward": 0.5, "kl": 0.125})
  got = _scalars(_events(tmp_path / "tb"))
  assert got == [(1, {"loss": 0.5, "reward": 0.25}), (2, {"loss": 0.75, "reward": 0.5,
                                                          "kl": 0.125})]


def test_a_resumed_run_marks_the_purge_before_its_recomputed_steps(tmp_path):
  with MetricsLogger(str(tmp_path)) as log:
    for step in (1, 2, 3):
      log.write(step, {"loss": float(step)})
  with MetricsLogger(str(tmp_path), resume_step=2) as log:
    log.write(3, {"loss": 30.0})
  events = _events(tmp_path / "tb")
  purge = [i for i, e in enumerate(events) if e.session_log.status == 1]  # SessionLog.START
  assert len(purge) == 1 and events[purge[0]].step == 2
  assert _scalars(events[purge[0]:]) == [(3, {"loss": 30.0})]
  assert _scalars(events[:purge[0]]) == [(s, {"loss": float(s)}) for s in (1, 2, 3)]
