#!/bin/bash
# Runs the same command on every worker of a Cloud TPU VM pod slice; JAX reads the pod's topology
# itself (jax.distributed.initialize() with no arguments, see disa_jax/parallel/distributed.py).
#   TPU=my-v5p-64 ZONE=us-east5-a bash launch/tpu_pod.sh launch.sft --config=configs/sft_paper.py:qwen3-4b-base \
#       --config.reference_path=/mnt/models/Qwen3-4B-Base --config.stage1_path=gs://... 
# The repository must be at $REPO_DIR on every worker (e.g. `--worker=all --command "git clone ..."`)
# with its .venv installed (`bash launch/install.sh` plus `pip install 'jax[tpu]'`); paths given to
# the entry point must be visible from every worker (a shared mount or GCS).
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}"
: "${ZONE:?set ZONE to its zone}"
REPO_DIR=${REPO_DIR:-disa_jax}
ARGS=$(printf '%q ' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command \
  "cd $REPO_DIR && .venv/bin/python launch/multihost.py --check && .venv/bin/python launch/multihost.py $ARGS"
