#!/usr/bin/env bash
# The GPU figures of issue 41 (weight push, sampler) and the 4B train step, in one device call.
#
# Steps, in order of value, each skipped when the budget left is under its need:
#   env      nvidia-smi, jax and its devices, /dev/shm (made >= 24 GiB when root and smaller)
#   push     benchmarks/bench_weight_push.py: the flat push against the flat push through pinned
#            host memory, alternating, --reps 3, the whole model (both processes on the one GPU)
#   sample   benchmarks/bench_gpu_rollout.py: the ragged sampler at 256 rows (32 prompts x G = 8)
#            and at 64 rows, 1k new tokens, the XLA decode attention then the Pallas kernel
#   train    benchmarks/bench_gpu_train.py: one 16k packed row, remat on, the config's attention
#   dense    the dense reference sampler (today's path before the ragged cache) at 64 rows
#   long     the ragged sampler at 64 rows x 8k new tokens
# Usage, from the repository root (ml_collections, which the device image lacks, as a wheel in .whl/):
#   bash benchmarks/gpu_figures.sh          results under $OUT (unset: ./gpu_figures_out)
# CPU dry run: MODEL=tiny NEW=16 NEW_LONG=32 PROMPT_LEN=8 TRAIN_MODEL=skip bash benchmarks/gpu_figures.sh
# Knobs: BUDGET_S (default 470 s of wall time for all steps), MODEL (qwen3-4b-base), GPU (h200).
set -u
START=$(date +%s)
BUDGET=${BUDGET_S:-470}
MODEL=${MODEL:-qwen3-4b-base}
TRAIN_MODEL=${TRAIN_MODEL:-$MODEL}
NEW=${NEW:-1024}
NEW_LONG=${NEW_LONG:-8192}
PROMPT_LEN=${PROMPT_LEN:-256}
GPU=${GPU:-h200}
DIR=${OUT:-$PWD/gpu_figures_out}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
LOG=$DIR/log.txt
: > "$LOG"
[ -f disa_jax/models/attention.py ] || { echo "run from the disa_jax repository root"; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# step NAME NEED_S CMD...: CMD under a timeout of the budget left, if NEED_S seconds are left.
step() {
  local name=$1 need=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt "$need" ]; then echo "== $name: skipped (${l}s left, needs ${need}s)" | tee -a "$LOG"; return 0; fi
  echo "== $name (${l}s left): $*" | tee -a "$LOG"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$l" "$@" 2>&1 | grep -v '^rep \|^{' | tee -a "$LOG"
  echo "== $name: rc ${PIPESTATUS[0]}, $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

{
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; $PY -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
  df -h /dev/shm | tail -1
} 2>&1 | tee -a "$LOG"
free_gib=$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)
if [ "${free_gib:-0}" -lt 24 ] && [ "$(id -u)" = 0 ]; then
  mount -o remount,size=48G /dev/shm && df -h /dev/shm | tail -1 | tee -a "$LOG"
fi

step push 100 $PY benchmarks/bench_weight_push.py --model "$MODEL" --layers 0 --reps 3 \
  --paths flat,flat_pinned --copy-threads 8 --out "$DIR/weight_push_$GPU.jsonl"
step sample_256 150 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts 32 \
  --layouts ragged --decode-attention xla,pallas --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" \
  --reps 1 --out "$DIR/rollout_$GPU.jsonl"
step sample_64 100 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts 8 \
  --layouts ragged --decode-attention xla,pallas --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" \
  --reps 1 --out "$DIR/rollout_$GPU.jsonl"
if [ "$TRAIN_MODEL" != skip ]; then
  step train 130 $PY benchmarks/bench_gpu_train.py --models "$TRAIN_MODEL" --row-lens 16384 \
    --remat on --steps 2 --warmup 1 --no-matmul --out "$DIR/train_$GPU.jsonl"
fi
step dense_64 110 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts 8 \
  --layouts dense --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" --reps 1 --out "$DIR/rollout_$GPU.jsonl"
step sample_64_long 250 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts 8 \
  --layouts ragged --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_LONG" --reps 1 --out "$DIR/rollout_$GPU.jsonl"
echo "total $(( $(date +%s) - START ))s; results in $DIR" | tee -a "$LOG"
