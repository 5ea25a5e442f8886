#!/usr/bin/env bash
# Set everything up and run the main job on an embedded default, no cluster needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/device_plugin_demo.py "$@"
