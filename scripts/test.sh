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
if [ "$#" -gt 0 ]; then
  echo "== pytest $*"; exec python -m pytest -q --durations=15 "$@"
fi
# The whole suite is two pytest runs side by side: the real-cluster tests (marker realcluster) spend most of their
# time waiting on leases, watches and control-plane start-ups (about a quarter of a core), the rest is CPU-bound.
# The rest runs at a lower priority, so the control planes' heartbeats and leases keep their timing. Each run
# writes its own log, printed when both are done (a failing one last, so the end of the output shows it).
logs=.cache/pytest; mkdir -p "$logs"
echo "== pytest: the real-cluster tests beside the rest (logs in $logs/)"
started=$SECONDS
python -m pytest -q --durations=15 -m realcluster -p no:cacheprovider >"$logs/realcluster.log" 2>&1 & real=$!
nice -n 10 python -m pytest -q --durations=15 -m "not realcluster" >"$logs/rest.log" 2>&1 & rest=$!
trap 'kill "$real" "$rest" 2>/dev/null || true' EXIT  # interrupted: neither run goes on alone
progress() { grep -E '^[.sxXFE]+( *\[ *[0-9]+%\])?$' "$1" 2>/dev/null | tr -cd '.sxXFE' | wc -c; }  # tests done
next=60
while kill -0 "$real" 2>/dev/null || kill -0 "$rest" 2>/dev/null; do
  sleep 2
  if (( SECONDS - started >= next )); then
    echo "   $(( next / 60 )) min: $(progress "$logs/realcluster.log") real-cluster tests done, $(progress "$logs/rest.log") others"
    next=$(( next + 60 ))
  fi
done
rc_real=0; wait "$real" || rc_real=$?
rc_rest=0; wait "$rest" || rc_rest=$?
order=(realcluster rest); [ "$rc_real" -ne 0 ] && [ "$rc_rest" -eq 0 ] && order=(rest realcluster)
for part in "${order[@]}"; do echo "== pytest, $part ($logs/$part.log)"; cat "$logs/$part.log"; done
echo "== pytest: realcluster exit $rc_real ($(tail -1 "$logs/realcluster.log")); rest exit $rc_rest ($(tail -1 "$logs/rest.log")); $(( SECONDS - started )) s"
[ "$rc_real" -eq 0 ] && [ "$rc_rest" -eq 0 ]
