# taskledger — `make run` serves, `make test` runs the whole suite.
# Both create the virtual environment in .venv and install what they need.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test deep mutation lint typecheck openapi bench acceptance cluster clean help

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,dev,mcp,otel]'
	touch $(STAMP)

run: $(STAMP)  ## serve on 127.0.0.1:8080 (embedded PostgreSQL unless TASKLEDGER_DATABASE_URL is set)
	$(BIN)/taskledger serve

test: $(STAMP)  ## run the whole test suite (embedded PostgreSQL unless TASKLEDGER_TEST_DATABASE_URL is set)
	$(BIN)/pytest $(PYTEST_ARGS)

deep: $(STAMP)  ## the property tests with many more (random) examples; failures kept in .hypothesis/examples
	HYPOTHESIS_PROFILE=deep $(BIN)/pytest -q -p no:cacheprovider tests/unit/test_task_machine.py

$(VENV)/.mutation: $(STAMP)
	$(BIN)/pip install -q -e '.[mutation]'
	touch $@

mutation: $(VENV)/.mutation  ## mutmut over the decision modules against the fast pure tests (~6 min on 2 cores, not in CI); docs/TESTING.md
	rm -rf mutants
	HYPOTHESIS_PROFILE=mutation $(BIN)/mutmut run --max-children 2 > /dev/null || true
	$(BIN)/python -m tests.mutation_report

lint: $(STAMP)  ## ruff, then the import contracts (lint-imports; [tool.importlinter] in pyproject.toml)
	$(BIN)/ruff check service events log projections taskledger/client taskledger/mcp tests bench deploy
	$(BIN)/lint-imports

typecheck: $(STAMP)  ## mypy --strict on the packages
	$(BIN)/mypy

openapi: $(STAMP)  ## rewrite openapi/openapi.json from the app
	$(BIN)/python -m taskledger.service.http.openapi > openapi/openapi.json

bench: $(STAMP)  ## run every benchmark (a quarter of an hour; figures in docs/BENCHMARKS.md)
	$(BIN)/python -m bench.append_http
	$(BIN)/python -m bench.queue
	$(BIN)/python -m bench.sse_latency --subscribers 1000 --seconds 20 --rate 10
	$(BIN)/python -m bench.sse_capacity --subscribers 10000 --seconds 20
	$(BIN)/python -m bench.sse_catchup
	$(BIN)/python -m bench.rebuild
	$(BIN)/python -m bench.jobs_memory
	$(BIN)/python -m bench.fault_drills

cluster: $(STAMP)  ## 3 replicas behind HAProxy on 127.0.0.1:8080 and a PostgreSQL of their own; Ctrl-C stops all (CLUSTER_ARGS=--standby ...)
	$(BIN)/python -m deploy.cluster $(CLUSTER_ARGS)

acceptance:  ## the black-box acceptance suite from ../shared
	../shared/acceptance/run.sh

clean:  ## remove the virtual environment and local data
	rm -rf $(VENV) .taskledger
