#!/usr/bin/env bash
# Debian packages the node-health tests need: promtool and prometheus (package "prometheus") for the alert-rule
# unit tests and the scrape integration test. Installed only when missing and only as root (CI runs as root);
# elsewhere those tests skip with the reason (or fail under ACCELSTACK_STRICT=1).
set -uo pipefail
need=()
{ command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; } || need+=(prometheus)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the alert-rule tests will report it" >&2
fi
exit 0
