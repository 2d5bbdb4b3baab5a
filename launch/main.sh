#!/usr/bin/env bash
# From zero, one command: installs .venv on first use (launch/install.sh; about a second when it is
# already complete), then runs the main job. Flags pass through to `python -m launch.main`; the
# workdir defaults to /tmp/disa_main (rerunning resumes there).
#   bash launch/main.sh
#   bash launch/main.sh --workdir=/tmp/claims --config=configs/main.py:claims_quick
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
args=("$@")
case " $* " in
  *" --workdir="*|*" --workdir "*) ;;
  *) args=(--workdir=/tmp/disa_main "${args[@]}") ;;
esac
exec .venv/bin/python -m launch.main "${args[@]}"
