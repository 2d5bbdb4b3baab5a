"""The sigma_g study of issue 9 on a finished main-job workdir: Stage 2 label / weighting variants vs the
exact log Z.

Reads (never writes) ``WORKDIR/stage1/pool.jsonl`` (the i.i.d. proposal pool), ``WORKDIR/exact.json``
(exact log Z per prompt) and ``WORKDIR/models/reference`` (pi_ref, for the mean-pooled prompt
embeddings, as `SumJob.stage2` makes them), runs `sigma_g_study` with the main job's Stage 2 settings
(`configs/main.py`) and prints the markdown table, the verdict and the wall time.

    python benchmarks/bench_anchor_variants.py --workdir /tmp/mj3 [--repeats 4] [--folds 5] [--json out.json]
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from disa_jax import codec
from disa_jax import estimators as E
from disa_jax.anchor import AnchorFitConfig
from disa_jax.anchor.embeddings import embed_prompts
from disa_jax.models import from_pretrained
from disa_jax.pipeline.anchor_study import format_sigma_table, sigma_g_study, sigma_verdict
from disa_jax.tasks.sum import SumTask, make_tokenizer


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--repeats", type=int, default=4)
  ap.add_argument("--folds", type=int, default=5)
  ap.add_argument("--epochs", type=int, default=None, help="override the main config's Stage 2 epochs")
  ap.add_argument("--val-fraction", type=float, default=None,
                  help="override the main config's Stage 2 val_fraction (0: keep the last epoch)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--huber", type=float, nargs="*", default=[0.0],
                  help="regression losses: 0 = least squares, > 0 = Huber threshold (standardised units)")
  ap.add_argument("--json", default=None, help="also write the raw result here")
  args = ap.parse_args()
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for configs/
  from configs.main import get_config  # the main job's Stage 2 settings
  c = get_config()
  wd = Path(args.workdir)
  pool = E.load_stage1(wd / "stage1" / "pool.jsonl")
  exact = json.loads((wd / "exact.json").read_text())
  ns = [int(pid[3:]) for pid in pool.prompt_ids]  # prompt ids are 'sum%04d' (SumTask.prompt_id)
  by_n = dict(zip(exact["ns"], exact["log_z"]))
  missing = [n for n in ns if n not in by_n]
  if missing:
    raise ValueError(f"exact.json has no log Z for n = {missing}")
  if float(exact["beta"]) != pool.beta:
    raise ValueError(f"exact.json beta={exact['beta']} differs from the pool's beta={pool.beta}")
  exact_log_z = np.asarray([by_n[n] for n in ns])

  t0 = time.time()
  tok = make_tokenizer()
  task = SumTask(c.task.n_min, c.task.n_max)
  ids = [tok.encode(task.prompt(n), add_special_tokens=False) for n in ns]
  emb, _ = embed_prompts(from_pretrained(str(wd / "models" / "reference")), ids, pad_id=tok.pad_token_id)
  t_emb = time.time() - t0

  fit = AnchorFitConfig(hidden_sizes=tuple(c.stage2.hidden_sizes), learning_rate=c.stage2.learning_rate,
                        batch_size=c.stage2.batch_size, epochs=args.epochs or c.stage2.epochs,
                        val_fraction=c.stage2.val_fraction if args.val_fraction is None else args.val_fraction,
                        seed=c.seed)
  res = sigma_g_study(emb, pool, exact_log_z, ns=tuple(c.stage1.n_study), folds=args.folds, repeats=args.repeats,
                      fit=fit, seed=args.seed, huber_deltas=tuple(args.huber))
  print(f"workdir {wd}: P = {len(ns)} prompts, pool {res.pool_size} samples each, beta {pool.beta}, "
        f"label scale {pool.label_scale}; fit: hidden {fit.hidden_sizes}, batch {fit.batch_size}, "
        f"{fit.epochs} epochs, "
        f"{'best epoch on an inner val split of %g' % fit.val_fraction if fit.val_fraction else 'last epoch kept'}, "
        f"lr {fit.learning_rate}\n")
  print(format_sigma_table(res))
  print("\nVerdict:\n" + sigma_verdict(res).text)
  print(f"\ntime: embeddings {t_emb:.1f} s, study {res.seconds:.1f} s")
  if args.json:
    Path(args.json).write_text(json.dumps(codec.encode(res), indent=1))


if __name__ == "__main__":
  main()
