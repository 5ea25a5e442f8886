#!/usr/bin/env bash
# Set everything up and run the whole test suite: lint (ruff), types (mypy), then pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh -k device_plugin).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/system-deps.sh
. .venv/bin/activate
# The real control plane for the tests marked realcluster (envtest's variable): from ../shared/k8s when it is
# beside the checkout, else whatever KUBEBUILDER_ASSETS already names (README: "Testing against a real
# control plane" says where to get the same binaries).
if [ -z "${KUBEBUILDER_ASSETS:-}" ] && [ -x ../shared/k8s/unpack.sh ]; then
  assets=$PWD/.cache/k8s-bin
  echo "== unpacking ../shared/k8s into $assets"
  ../shared/k8s/unpack.sh "$assets" >/dev/null
  export KUBEBUILDER_ASSETS=$assets
fi
if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
  for tool in etcd kubectl; do   # Debian's etcd-server and kubectl, linked in where the folder lacks them
    [ -e "$KUBEBUILDER_ASSETS/$tool" ] || ! command -v $tool >/dev/null || ln -sf "$(command -v $tool)" "$KUBEBUILDER_ASSETS/$tool"
  done
  echo "== real control plane: KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
fi
echo "== ruff"; ruff check .
targets=(); for d in kubeapi service device_plugin scheduler_extender npd cni inference protos tests bench scripts; do [ -d "$d" ] && targets+=("$d"); done
echo "== mypy"; mypy "${targets[@]}"
# the slowest tests are listed at the end, so a CI log shows where the suite's time goes (its 15-minute aim)
echo "== pytest"; python -m pytest -q --durations=15 "$@"
