#!/usr/bin/env bash
# Regenerates the checked-in Python code and typed stubs for every protos/*.proto, compiled
# through the fthsdp/protos link so the generated imports name the installed package.
# The generator versions are pinned in pyproject.toml's dev extras (grpcio-tools, mypy-protobuf);
# tests/unit/test_protos_in_sync.py fails when the checked-in files drift from this output.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-.}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
PATH="$BIN:$PATH" "$PY" -m grpc_tools.protoc -I. \
  --python_out="$OUT" --grpc_python_out="$OUT" \
  --mypy_out="$OUT" --mypy_grpc_out="$OUT" \
  fthsdp/protos/*.proto
