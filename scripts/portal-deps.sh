#!/usr/bin/env bash
# Debian packages the admin portal's browser tests (tests/portal/test_portal_browser.py) and its benchmark need:
# chromium and chromium-driver, driven through the selenium package (a dev extra). Installed only when missing
# and only as root (CI runs as root); elsewhere the browser tests skip with the reason (and fail under
# ACCELSTACK_STRICT=1).
set -uo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing ${need[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null) \
    || echo "warning: could not install ${need[*]}; the portal's browser tests will report it" >&2
fi
exit 0
