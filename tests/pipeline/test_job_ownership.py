"""The main job owns its workdir (issue 65), through `launch/main.py`: a second job on the same
workdir is refused within seconds in one line naming the holder's pid and preset; a job killed
while saving a model or the prompt file leaves nothing a rerun trusts (the rerun writes them
whole). The job is the default preset at tiny sizes (`_config`), its faults injected by
main_job_fault_worker.py."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from configs import main as main_config
from disa_jax import models
from disa_jax.pipeline.sum_job import prompt_records
from disa_jax.tasks.sum import SumTask

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "pipeline" / "main_job_fault_worker.py"


def _env():
  return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", XLA_FLAGS="")


def _config(tmp_path, preset=""):
  """The ``preset`` job at tiny sizes, stopping after Stage 2 (``stages='anchor'``)."""
  path = tmp_path / f"cfg_{preset or 'default'}.py"
  path.write_text(f"""from configs import main


def get_config():
  c = main.get_config({preset!r})
  c.stages, c.seeds, c.task.n_max = "anchor", (0,), 6
  c.reference_model.steps, c.proposal_model.steps = 6, 3
  c.arch.hidden_size, c.arch.intermediate_size = 32, 64
  c.stage1.sampling.n, c.stage2.samples, c.n_study = 4, 4, (2, 4)
  c.nstudy.enabled, c.anchor_study.repeats, c.stage2.fit.epochs = False, 0, 2
  return c
""")
  return str(path)


def _main(workdir, config):
  return [sys.executable, "-m", "launch.main", f"--workdir={workdir}", f"--config={config}"]


@pytest.mark.slow  # two main-job commands started (~30 s on 2 cores)
def test_a_second_job_on_the_same_workdir_is_refused_in_seconds_naming_pid_and_preset(tmp_path):
  work = tmp_path / "work"
  first = subprocess.Popen(_main(work, _config(tmp_path)), env=_env(), cwd=ROOT,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
  try:
    deadline = time.time() + 300
    # the job makes its workdir as it starts, then locks it (the second one's imports take longer)
    while not work.exists():
      assert first.poll() is None and time.time() < deadline, first.stderr.read()[-3000:]
      time.sleep(0.05)
    t0 = time.time()
    second = subprocess.run(_main(work, _config(tmp_path, "claims_quick")), env=_env(), cwd=ROOT,
                            capture_output=True, text=True, timeout=120)  # (on 82d599f: it trains)
    seconds = time.time() - t0
    assert first.poll() is None  # the first job still runs
  finally:
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
  errors = [l for l in second.stderr.splitlines() if l.startswith("error:")]
  assert second.returncode == 2 and len(errors) == 1, second.stderr[-3000:]
  assert f"the main job's workdir {work} is being written by another process (pid {first.pid}, " \
         f"preset 'default'; lock file {work / 'job.lock'})" in errors[0], errors
  print(f"second job refused after {seconds:.1f} s")
  assert seconds < 60


def _worker(point, workdir, config, expect):
  out = subprocess.run([sys.executable, str(WORKER), point, f"--workdir={workdir}",
                        f"--config={config}"], env=_env(), cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == expect, (point, out.returncode, out.stderr[-3000:])


@pytest.mark.slow  # three tiny main-job starts, two models trained (~2 min on 2 cores)
def test_a_job_killed_mid_save_leaves_no_model_or_prompt_file_the_rerun_trusts(tmp_path):
  work, config = tmp_path / "work", _config(tmp_path)
  _worker("kill_mid_model_save", work, config, -signal.SIGKILL)
  assert not (work / "models" / "reference" / "warmup.json").exists()
  _worker("kill_mid_prompts_save", work, config, -signal.SIGKILL)  # the rerun: both models saved
  _worker("stop_after_models", work, config, 0)  # the second rerun
  for name in ("reference", "proposal"):
    path = work / "models" / name
    assert (path / "warmup.json").exists() and not Path(f"{path}.partial").exists()
    models.read_checkpoint_tensors(str(path))  # whole: every tensor reads
  rows = [json.loads(l) for l in (work / "data" / "sum_prompts.jsonl").read_text().splitlines()]
  task = SumTask(main_config.get_config().task.n_min, 6)
  assert rows == [json.loads(json.dumps(r.to_verl_row())) for r in prompt_records(task)]
