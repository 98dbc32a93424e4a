#!/usr/bin/env bash
# What the tests need beyond Python packages: redis-server (the store's Redis tier, started by the
# tests themselves on a private 127.0.0.1 port with a temp dir) and Chromium (the report-render test).
# Idempotent and quiet: does nothing when both are present; one clear line when it cannot install.
set -uo pipefail
missing=()
command -v redis-server >/dev/null || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [ -x /usr/bin/chromium ] \
  || missing+=(chromium)
[ ${#missing[@]} -eq 0 ] && exit 0
cannot() {
  echo "install-test-deps: could not install ${missing[*]} ($1): run 'sudo apt-get install -y ${missing[*]}'; until then their tests skip (and make test fails on skips)" >&2
  exit 0  # the test run itself reports the skipped tests and what to install
}
command -v apt-get >/dev/null || cannot "no apt-get on this machine"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO=(sudo -n)
else
  cannot "not root and no password-less sudo"
fi
echo "install-test-deps: installing ${missing[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq >/dev/null 2>&1 || true
"${SUDO[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
  || cannot "apt-get install failed"
