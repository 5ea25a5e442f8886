#!/usr/bin/env bash
# Debian packages some tests need as real peers. Installed only when missing and only as root
# (CI runs as root); elsewhere the tests that need them skip with the reason.
set -uo pipefail
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)   # kubectl kustomize for the manifest tests
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)             # the real control plane's store (realcluster tests)
command -v xz >/dev/null 2>&1 || need+=(xz-utils)                  # ../shared/k8s/unpack.sh
command -v openssl >/dev/null 2>&1 || need+=(openssl)              # the control plane's throwaway CA
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; tests that need them will report it" >&2
fi
# component-specific packages (each script installs only what is missing)
dir=$(dirname "$0")
for extra in "$dir/cni-deps.sh" "$dir/npd-deps.sh" "$dir/portal-deps.sh"; do
  [ -f "$extra" ] && bash "$extra"
done
exit 0
