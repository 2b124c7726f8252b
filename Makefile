# The two set-up commands of the README:
#   make run   - the main job: the daemon on this node's GPUs, or on a simulated node without them
#   make test  - the whole test suite (installs what it needs first)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Not root: keep the daemon's sockets and audit log in the checkout instead of /run and /var/lib.
ifneq ($(shell id -u),0)
export GPUWATCH_RUNTIME_DIR ?= $(CURDIR)/.run/runtime
export GPUWATCH_STATE_DIR ?= $(CURDIR)/.run/state
endif

.PHONY: run test test-deps lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

run: $(STAMP)
	@if $(BIN)/python -c 'import pynvml; pynvml.nvmlInit()' 2>/dev/null; then \
		exec $(BIN)/gpuwatch daemon; \
	else \
		echo "make run: no NVIDIA driver answers on this machine; running the daemon on a simulated node"; \
		exec $(BIN)/gpuwatch demo; \
	fi

# promtool and prometheus for the exporter and end-to-end tests, from Debian's package.
test-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends prometheus >/dev/null; \
		else \
			echo "make test: prometheus/promtool missing and cannot apt-get; those tests will skip"; \
		fi; }

lint: $(STAMP)
	$(BIN)/ruff check gpuwatch tests bench dashboards

test: $(STAMP) test-deps lint
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/run.py

clean:
	rm -rf $(VENV) .run build *.egg-info .pytest_cache .ruff_cache
