#!/usr/bin/env bash
# What the tests need beyond Python packages: redis-server (the store's Redis tier, started by the
# tests themselves on a private 127.0.0.1 port) and Chromium (the report-render test). Idempotent.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing ${missing[*]} for the tests (apt-get)"
if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
  echo "could not install ${missing[*]}: install them by hand (apt-get install -y ${missing[*]}); their tests will be skipped" >&2
fi
