# Two commands do all the set-up: `make demo` runs the main job, `make test` runs every test.
# Both create/update .venv from pyproject.toml first (pip; torch comes from the local wheel
# cache where there is one).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
# Test processes (pytest-xdist): two on the 2 cores. Three kept the cores busier while one
# waited out an outage or a server start (82 % busy against 61 %), but cost more CPU for
# the same tests: 1,632 CPU-seconds in 16 min 37 s against 1,518 in 20 min 51 s (same code,
# machine and hour, docs/testing.md), each process collecting the suite and starting its own
# forkserver, and the three contending for two cores. Each integration module is one unit of
# work (tests/conftest.py). TEST_PROCS=0 runs everything in one process.
TEST_PROCS ?= 2

.PHONY: venv demo test test-unit lint mlflow-ui clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	# Prefect's migrated database, copied by a flow's first embedded API instead of 5 s of
	# migrations (ddpflow/integrations/prefect/db_template.py).
	$(BIN)/python -m ddpflow.integrations.prefect.db_template
	# MLflow's migrated SQLite store, copied by a project's first run the same way
	# (ddpflow/tracking/store/template.py).
	$(BIN)/python -m ddpflow.tracking.store.template
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m flows.train_charlm $(ARGS)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	$(BIN)/python -m pytest -m "not gpu" -n $(TEST_PROCS) --dist loadscope --no-loadscope-reorder \
		--durations=25 $(ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit -n $(TEST_PROCS) --dist loadscope --no-loadscope-reorder $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

# MLflow 3.17's server imports Starlette's deprecated WSGI middleware, which warns once per
# server process: not something a user of this command can act on.
mlflow-ui: $(STAMP)
	PYTHONWARNINGS="ignore:starlette.middleware.wsgi is deprecated" $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf artifacts mlartifacts mlruns mlflow.db mlflow.db.lock

# Local production-like stack (infra/README.md), e.g. make stack-up ARGS="--free-ports".
.PHONY: stack-up stack-down stack-status

stack-up: $(STAMP)
	$(BIN)/python -m infra.stack up $(ARGS)

stack-down: $(STAMP)
	$(BIN)/python -m infra.stack down $(ARGS)

stack-status: $(STAMP)
	$(BIN)/python -m infra.stack status $(ARGS)
