# The two commands of the README: `make demo` and `make test`. Both prepare the machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin

.PHONY: setup setup-test demo test lint typecheck unit protos

setup:
	@bash scripts/bootstrap.sh

setup-test:
	@bash scripts/bootstrap.sh test

demo: setup
	$(BIN)/fthsdp demo $(ARGS)

test: setup-test
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/pytest $(PYTEST_ARGS)

protos: setup
	bash scripts/gen_protos.sh
