#!/usr/bin/env bash
# Debian packages the CNI plugin's tests and benchmark need as real peers: iproute2 (ip netns), util-linux
# (nsenter) and containernetworking-plugins (the reference host-device plugin and the host-local / static
# IPAM delegates, in /usr/lib/cni). Installed only when missing and only as root (CI runs as root);
# elsewhere the CNI tests skip with the reason (and fail under ACCELSTACK_STRICT=1).
set -uo pipefail
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v nsenter >/dev/null 2>&1 || need+=(util-linux)
for plugin in host-device host-local static; do
  if [ ! -x "/usr/lib/cni/$plugin" ]; then need+=(containernetworking-plugins); break; fi
done
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the CNI tests will report it" >&2
fi
exit 0
