# The two set-up commands of the README:
#   make run   - the main job: the daemon on this node's GPUs, or on a simulated node without them
#   make test  - the whole test suite (installs what it needs first)
#   make test-fast - the tests of the pure layers alone, under a minute (docs/testing.md)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# PyTorch's CPU build, for the tests that run real PyTorch programs (the culprit end-to-end
# tests, the agent's torch tests): `make test` installs it where pip can, and those tests skip,
# saying why, where it cannot. TORCH_PIP_ARGS says where from: on a machine that would get the
# CUDA build from PyPI, `--index-url https://download.pytorch.org/whl/cpu` gets the CPU one.
TORCH ?= torch==2.13.0
# accelerate, whose own `accelerate launch` the real-launcher tests run (installed beside torch,
# which it needs; they skip, saying why, where it is not).
ACCELERATE ?= accelerate==1.15.0
TORCH_PIP_ARGS ?=
TORCH_STAMP := $(VENV)/.torch
# Not root: keep the daemon's sockets and audit log in the checkout instead of /run and /var/lib.
ifneq ($(shell id -u),0)
export GPUWATCH_RUNTIME_DIR ?= $(CURDIR)/.run/runtime
export GPUWATCH_STATE_DIR ?= $(CURDIR)/.run/state
endif

.PHONY: run test test-fast test-deps bytecode lint typecheck bench clean test-gpu bench-gpu gpu-venv

$(STAMP): pyproject.toml
	@echo "make: creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "make: upgrading pip in $(VENV)"
	$(BIN)/python -m pip install -q --upgrade pip
	@echo "make: installing gpuwatch and its test dependencies into $(VENV) (a minute or two)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

run: $(STAMP)
	@if $(BIN)/python -c 'import pynvml; pynvml.nvmlInit()' 2>/dev/null; then \
		exec $(BIN)/gpuwatch daemon; \
	else \
		echo "make run: no NVIDIA driver answers on this machine; running the daemon on a simulated node"; \
		exec $(BIN)/gpuwatch demo; \
	fi

# promtool, prometheus and alertmanager for the exporter, alert and end-to-end tests, and tmux
# for the terminal-UI tests of `gpuwatch top`, from Debian's packages.
test-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null \
		&& command -v prometheus-alertmanager >/dev/null && command -v tmux >/dev/null || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "make test: installing prometheus, prometheus-alertmanager and tmux" \
				"(Debian packages, for promtool and the end-to-end tests)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
				--no-install-recommends prometheus prometheus-alertmanager tmux >/dev/null; \
		else \
			echo "make test: prometheus/promtool/alertmanager/tmux missing and cannot" \
				"apt-get; those tests will skip"; \
		fi; }

lint: $(STAMP)
	$(BIN)/ruff check gpuwatch tests bench dashboards

# The typed public surface (the files are listed under [tool.mypy] in pyproject.toml).
typecheck: $(STAMP)
	$(BIN)/mypy

# Tried once per venv (`make clean` to try again): a pip that cannot reach a PyTorch build
# would otherwise cost its timeouts at every run.
$(TORCH_STAMP): $(STAMP)
	@$(BIN)/python -c 'import torch' 2>/dev/null \
		|| { echo "make test: installing PyTorch's CPU build ($(TORCH)) for the tests of real PyTorch programs"; \
		     $(BIN)/python -m pip install -q $(TORCH_PIP_ARGS) '$(TORCH)'; } \
		|| echo "make test: could not install $(TORCH) (pip says why above):" \
			"the tests that run PyTorch programs will skip"
	@$(BIN)/python -c 'import torch' 2>/dev/null && { $(BIN)/python -c 'import accelerate' 2>/dev/null \
		|| { echo "make test: installing $(ACCELERATE) for the tests of its real launcher"; \
		     $(BIN)/python -m pip install -q '$(ACCELERATE)'; } \
		|| echo "make test: could not install $(ACCELERATE) (pip says why above):" \
			"the test of its real launcher will skip"; } || true
	@touch $@

# The whole suite in parallel (pytest-xdist, `pytest -n`): as root, each worker in a PID
# namespace of its own with its own /proc (tests/worlds.py), so that the daemons and jobs of one
# do not see another's, nor a second suite's on the same host. Not root, the workers would share
# the host, and the suite runs in one process. TEST_WORKERS=N chooses (0: one process).
TEST_WORKERS ?= $(if $(filter 0,$(shell id -u)),6,0)

# The suite starts some thousands of Python interpreters (daemons, CLI commands, simulated
# jobs) from this tree, and each pytest worker imports every test module. With
# PYTHONDONTWRITEBYTECODE set, as on many CI machines, each would compile what it imports again:
# so the tree's bytecode is compiled once before them (compileall), and pytest's
# assertion-rewritten test modules are written once by one collection (each worker's collection
# then takes 2.5 s of CPU instead of 6). The caches are ignored build outputs.
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q -j 0 gpuwatch tests bench
	@PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -q -p no:cacheprovider \
		>/dev/null || true

# The slowest tests are listed at the end (--durations); tests/conftest.py names each test of
# the end-to-end modules that run for minutes as it starts.
test: $(STAMP) $(TORCH_STAMP) test-deps lint typecheck bytecode
	@echo "make test: running the test suite ($(TEST_WORKERS) workers; docs/testing.md says how long)"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15 --durations-min=10

# The tests not marked `slow` (tests/conftest.py SLOW: the end-to-end modules, listed in
# docs/testing.md): the pure layers, in under a minute. `make test` still runs everything.
test-fast: $(STAMP) bytecode
	$(BIN)/python -m pytest -m "not slow" -q

bench: $(STAMP)
	$(BIN)/python bench/run.py

# The `gpu` tests (tests/gpu) and the real-NVML bench, on this node's NVIDIA GPUs. Where
# $(PYTHON) already has PyTorch and gpuwatch's dependencies (a GPU node without network), they run
# with it as it is, the checkout on PYTHONPATH, and nothing is installed. Otherwise they run in
# the venv, which gets PyTorch first where a GPU answers: without one the tests skip anyway, and
# PyTorch is several GiB.
GPU_MISSING = $(PYTHON) -c 'import importlib.util as u, sys; \
	need = ["torch", "pynvml", "prometheus_client", "click", "pytest"]; \
	need += [] if sys.version_info >= (3, 11) else ["tomli"]; \
	print(" ".join(m for m in need if u.find_spec(m) is None))'

test-gpu:
	@missing="$$($(GPU_MISSING) || echo python)"; \
	if [ -z "$$missing" ]; then \
		echo "make test-gpu: $(PYTHON) has PyTorch and every dependency; installing nothing"; \
		PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m pytest -m gpu tests/gpu; \
	else \
		echo "make test-gpu: $(PYTHON) lacks $$missing; running in $(VENV)"; \
		$(MAKE) --no-print-directory gpu-venv && $(BIN)/python -m pytest -m gpu tests/gpu; \
	fi

bench-gpu:
	@missing="$$($(GPU_MISSING) || echo python)"; \
	if [ -z "$$missing" ]; then \
		$(PYTHON) bench/real_nvml.py; \
	else \
		$(MAKE) --no-print-directory gpu-venv && $(BIN)/python bench/real_nvml.py; \
	fi

gpu-venv: $(STAMP)
	@if $(BIN)/python -c 'import torch' 2>/dev/null; then :; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
		echo "make: installing PyTorch into $(VENV) (several GiB)"; \
		$(BIN)/python -m pip install -q torch; \
	else \
		echo "make: no NVIDIA GPU answers here (nvidia-smi -L), so PyTorch is not installed:" \
			"the gpu tests skip and bench/real_nvml.py has nothing to measure"; \
	fi

clean:
	rm -rf $(VENV) .run build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
	find gpuwatch tests bench -name __pycache__ -prune -exec rm -rf {} +
