#!/usr/bin/env bash
# Prepares a fresh machine for fthsdp: a virtual environment in .venv with the CPU build of torch,
# the project with its dev extras, and redis-server. Safe to run again; it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${FTHSDP_VENV:-.venv}

if ! command -v redis-server >/dev/null 2>&1; then
  echo "bootstrap: installing redis-server" >&2
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "bootstrap: creating $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi

# Reinstall only when the dependency declaration changed since the last successful install.
stamp="$VENV/.fthsdp-installed"
want=$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: installing dependencies into $VENV" >&2
  "$VENV/bin/pip" install -q --upgrade pip
  # The CPU build first: a bare torch requirement would otherwise resolve to a CUDA build.
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
