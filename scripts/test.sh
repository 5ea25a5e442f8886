#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint (ruff), types (mypy), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k device_plugin).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/system-deps.sh
. .venv/bin/activate
echo "== ruff"; ruff check .
targets=(); for d in kubeapi device_plugin scheduler_extender npd cni inference protos tests bench scripts; do [ -d "$d" ] && targets+=("$d"); done
echo "== mypy"; mypy "${targets[@]}"
echo "== pytest"; python -m pytest -q "$@"
