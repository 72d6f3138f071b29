#!/usr/bin/env bash
# Prepares a fresh machine for fthsdp: a virtual environment in .venv with the CPU build of torch,
# the project with its dev extras and redis-server; with the argument `test`, also chromium (the
# dashboard test drives it; the demo never needs a browser). Safe to run again; it skips what is
# done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${FTHSDP_VENV:-.venv}

# apt_install PACKAGE PATH: installs a Debian package when PATH is not an executable yet.
apt_install() {
  if [ -x "$2" ] || command -v "$(basename "$2")" >/dev/null 2>&1; then
    return
  fi
  echo "bootstrap: installing $1" >&2
  local sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "$1" >/dev/null
}

apt_install redis-server /usr/bin/redis-server  # the Redis store, standby quorum, tests
if [ "${1:-}" = test ]; then
  apt_install chromium /usr/bin/chromium        # the dashboard test drives it headless
  apt_install iproute2 /usr/sbin/ip             # `ip netns`, veth, tc: the multi-host topology
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
