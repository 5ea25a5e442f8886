#!/usr/bin/env bash
# Set everything up and run the main job on an embedded default, no cluster needed: the simulator's demo (the
# policy core on the bundled Alibaba openb and Microsoft Philly traces, under a minute). Extra arguments go to
# `accelstack simulate demo` (e.g. --json out.json --plot out.png). The device plugin's own demo against the
# kubelet peer: .venv/bin/python scripts/device_plugin_demo.py
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/accelstack simulate demo "$@"
