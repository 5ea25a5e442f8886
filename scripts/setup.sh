#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv in .venv and install accelstack with its dev tools.
# Idempotent: a second run only re-checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "accelstack needs Python >= 3.11 (found: $("$PY" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.accelstack-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log=.venv/setup.log
  if ! { .venv/bin/python -m pip install -q --upgrade pip && .venv/bin/python -m pip install -q -e '.[dev]'; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "setup failed: pip could not install accelstack (log above, also in $log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
