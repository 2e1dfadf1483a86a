# Two entry points: `make demo` and `make test`. Both install into .venv first if needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# The suite waits on servers and subprocesses much of the time: two workers use the two CI cores.
TEST_WORKERS ?= 2

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

# constraints.txt is the resolved lock: same versions on every machine, `pip check` clean.
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test,k8s]"
	$(BIN)/pip check
	touch $(STAMP)

demo: install
	$(BIN)/tessera run configs/tiny.yaml
	@echo
	@echo "Results:"
	@echo "  MLflow:  $(BIN)/mlflow ui --backend-store-uri sqlite:///.tessera/mlflow.db   (http://127.0.0.1:5000)"
	@echo "  Prefect: PREFECT_HOME=.tessera/prefect $(BIN)/prefect server start           (http://127.0.0.1:4200)"

test: install
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --no-loadscope-reorder

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench: install
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf .tessera
