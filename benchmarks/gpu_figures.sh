#!/usr/bin/env bash
# The next GPU slot's figures (issue 66), in one device call of at most 8 minutes.
#
# Steps, in order of value, each skipped when the budget left is under its need:
#   env        nvidia-smi (names the machine: CARD and the result files), jax and its devices
#   compile    compiled memory first, nothing run: benchmarks/gpu_compile_sampler.py (the sampler's
#              prefill and decode step at 256 rows x (PROMPT_LEN + NEW), each decode attention, and
#              the Pallas kernel) and benchmarks/plan_memory.py --card (the 4B/16k train step with
#              REMAT_POLICY). A decode attention whose programs do not fit the card or whose decode
#              step has a data-dependent loop is not measured; nor is the train step if its check
#              fails (exit 1).
#   sample_256 benchmarks/bench_gpu_rollout.py: the ragged sampler at 256 rows (32 prompts x G = 8),
#              NEW new tokens, each decode attention that passed
#   train      benchmarks/bench_gpu_train.py: one 16k packed row, the auto attention, remat on
#              (REMAT_POLICY when the benchmark takes --remat-policy)
#   sample_64  the same sampler at 64 rows
#   push       benchmarks/bench_weight_push.py: the flat push, pageable and pinned, the whole model
# Results: $OUT (the device tool's; else benchmarks/results/gpu_figures_<card>/), each file named
# after the card; log.txt holds every step's output and rc.
#
# Usage, from the repository root:  bash benchmarks/gpu_figures.sh [--dry-run]
#   --dry-run: on this CPU at tiny shapes (MODEL=tiny, 16 rows and 8 rows of 16 new tokens after
#   8-token prompts, no train step; the compile step only where JAX's CUDA plugin is installed).
# Knobs: BUDGET_S (470 s of wall time for all steps), MODEL (qwen3-4b-base), TRAIN_MODEL
# (MODEL; 'skip'), REMAT_POLICY (full), NEW (1024), PROMPT_LEN (256), CARD (from nvidia-smi).
set -u
START=$(date +%s)
DRY=0
[ "${1:-}" = --dry-run ] && DRY=1
if [ $DRY = 1 ]; then
  : "${MODEL:=tiny}" "${NEW:=16}" "${PROMPT_LEN:=8}" "${TRAIN_MODEL:=skip}" "${PUSH_LAYERS:=1}"
  : "${CARD:=h100_sxm}" "${PUSH_MODEL:=tiny}" "${PROMPTS_256:=2}" "${PROMPTS_64:=1}" "${BUDGET_S:=1800}"
fi
BUDGET=${BUDGET_S:-470}
MODEL=${MODEL:-qwen3-4b-base}
TRAIN_MODEL=${TRAIN_MODEL:-$MODEL}
PUSH_MODEL=${PUSH_MODEL:-$MODEL}
PUSH_LAYERS=${PUSH_LAYERS:-0}
REMAT_POLICY=${REMAT_POLICY:-full}
NEW=${NEW:-1024}
PROMPT_LEN=${PROMPT_LEN:-256}
PROMPTS_256=${PROMPTS_256:-32}  # x G = 8 samples: 256 rows
PROMPTS_64=${PROMPTS_64:-8}
PY=${PYTHON:-python3}
[ -f disa_jax/models/attention.py ] || { echo "run from the disa_jax repository root"; exit 2; }
GPU_NAME=$(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [ -z "${CARD:-}" ]; then
  case "$GPU_NAME" in
    *H200*) CARD=h200 ;;
    *H100*) CARD=h100_sxm ;;
    *A100*80*) CARD=a100_sxm_80 ;;
    *) echo "unknown GPU '${GPU_NAME:-none}': set CARD (h200, h100_sxm, a100_sxm_80)"; exit 2 ;;
  esac
fi
DIR=${OUT:-$PWD/benchmarks/results/gpu_figures_$CARD}
mkdir -p "$DIR"
LOG=$DIR/log.txt
: > "$LOG"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}
if ls .whl/*.whl >/dev/null 2>&1; then  # ml_collections, which the device image lacks
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# step NAME NEED_S CMD...: CMD under a timeout of the budget left, if NEED_S seconds are left;
# its rc in RC.
step() {
  local name=$1 need=$2; shift 2
  local l; l=$(left)
  RC=skipped
  if [ "$l" -lt "$need" ]; then echo "== $name: skipped (${l}s left, needs ${need}s)" | tee -a "$LOG"; return 0; fi
  echo "== $name (${l}s left): $*" | tee -a "$LOG"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$l" "$@" > "$DIR/$name.out" 2>&1
  RC=$?
  grep -v '^rep \|^{' "$DIR/$name.out" | tee -a "$LOG" | tail -20
  echo "== $name: rc $RC, $(( $(date +%s) - t0 ))s" | tee -a "$LOG"
}

{
  echo "machine: ${GPU_NAME:-no GPU} (card $CARD), $(nproc) cores"
  $PY -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee -a "$LOG"

ATTN=xla,pallas
if [ $DRY = 1 ] && ! $PY -c "from disa_jax.parallel import gpu_compile as g; exit(not g.plugin_installed())" 2>/dev/null; then
  echo "== compile: skipped (dry run without JAX's CUDA plugin)" | tee -a "$LOG"
else
  step compile_sampler 150 env JAX_PLATFORMS=cpu $PY benchmarks/gpu_compile_sampler.py --card "$CARD" \
    --model "$MODEL" --rows 256 --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" \
    --decode-attention xla,pallas --no-push --no-fit-slots --print-passing \
    --json "$DIR/compile_sampler_$CARD.json"
  if [ "$RC" = 0 ]; then ATTN=$(tail -1 "$DIR/compile_sampler.out"); fi
  echo "decode attentions to measure: ${ATTN:-none}" | tee -a "$LOG"
fi
TRAIN_OK=1
if [ "$TRAIN_MODEL" != skip ]; then
  step compile_train 120 env JAX_PLATFORMS=cpu $PY benchmarks/plan_memory.py --card "$CARD" \
    --models "$TRAIN_MODEL" --rows 1 --row-lens 16384 --fsdp 1 --remat-policy "$REMAT_POLICY" \
    --no-dense-check --no-search --check --json "$DIR/compile_train_$CARD.json"
  [ "$RC" = 1 ] && TRAIN_OK=0 && echo "train step: its compiled check failed, not measured" | tee -a "$LOG"
fi

if [ -n "$ATTN" ]; then
  step sample_256 120 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts "$PROMPTS_256" \
    --layouts ragged --decode-attention "$ATTN" --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" \
    --reps 1 --out "$DIR/rollout_$CARD.jsonl"
fi
if [ "$TRAIN_MODEL" != skip ] && [ $TRAIN_OK = 1 ]; then
  POLICY=()
  $PY benchmarks/bench_gpu_train.py --help 2>/dev/null | grep -q -- --remat-policy \
    && POLICY=(--remat-policy "$REMAT_POLICY")
  step train 130 $PY benchmarks/bench_gpu_train.py --models "$TRAIN_MODEL" --row-lens 16384 \
    --remat on ${POLICY[@]+"${POLICY[@]}"} --attention-impl auto --steps 2 --warmup 1 --no-matmul \
    --out "$DIR/train_$CARD.jsonl"
fi
if [ -n "$ATTN" ]; then
  step sample_64 80 $PY benchmarks/bench_gpu_rollout.py --models "$MODEL" --prompts "$PROMPTS_64" \
    --layouts ragged --decode-attention "$ATTN" --prompt-len "$PROMPT_LEN" --new-tokens "$NEW" \
    --reps 1 --out "$DIR/rollout_$CARD.jsonl"
fi
step push 60 $PY benchmarks/bench_weight_push.py --model "$PUSH_MODEL" --layers "$PUSH_LAYERS" \
  --reps 1 --paths flat,flat_pinned --copy-threads 8 --out "$DIR/weight_push_$CARD.jsonl"
echo "total $(( $(date +%s) - START ))s on ${GPU_NAME:-no GPU}; results in $DIR" | tee -a "$LOG"
