# Two commands for a new machine: `make run` (generation on the bundled model) and `make test`.
# Both create .venv and install the pinned dependencies on first use.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.deepinfer-installed

.PHONY: run test test-fast setup compile-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	# the test tools and community Triton (its interpreter runs the CUDA kernels on the CPU)
	$(BIN)/pip install --quiet -e '.[test,cuda]'
	# the mooncake KV connector's RDMA libraries (Debian's names), installed where this user may
	@ldconfig -p | grep -q libibverbs.so.1 || { if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y -q libibverbs1 librdmacm1 >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 librdmacm1 >/dev/null 2>&1; } \
		|| echo "deepinfer: could not install libibverbs1 librdmacm1 (the mooncake KV connector needs them): sudo apt-get install libibverbs1 librdmacm1"; \
	else echo "deepinfer: the mooncake KV connector needs libibverbs1 and librdmacm1: sudo apt-get install libibverbs1 librdmacm1"; fi; }
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/deepinfer generate --prompt "def read_file(path):" --max-tokens 48

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# every CUDA Triton kernel compiled ahead of time for sm_90 and sm_100 at the launchers' configurations (no GPU needed)
compile-check: $(STAMP)
	DEEPINFER_COMPILE_SWEEP=1 $(BIN)/python -m pytest -q tests/backends/cuda/test_cuda_compile.py
