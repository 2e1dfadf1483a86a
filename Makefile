# Two entry points: `make demo` and `make test`. Both install into .venv first if needed.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# Four workers on the two CI cores: with two, 19% of the cores sat idle while tests waited on servers, budgets
# and outages (37 min, 2026-11-27); a third filled most of those waits, and with three the cores were still idle
# 15% of the time, often all three workers waiting at once (a cron tick, a watchdog budget, an outage; 2026-11-29),
# which a fourth fills. The tests' bounds are ceilings that hold at load 6.
TEST_WORKERS ?= 4
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-fast test-ui bench clean

install: $(STAMP)

# constraints.txt is the resolved lock: same versions on every machine, `pip check` clean. uv (pinned there too,
# bootstrapped into the venv by pip) installs them: with its cache warm, a fresh clone installs in about a
# minute (pip took 3 to 8). uv hardlinks from its cache (6 s for the 6.6 GB venv; copying took 46 s) and falls back
# to a copy by itself where the cache sits on another filesystem.
# No --compile-bytecode: compiling all 45,600 modules took 68 s, 40% of them the Oracle cloud SDK that streaming
# pulls in and nothing imports. Instead no recipe here inherits PYTHONDONTWRITEBYTECODE (set in CI and on this
# machine): each module's bytecode is written the first time any process imports it, so the suite and the demo
# compile only what they run, once. Where every process was kept from writing it, each trainer, rank and
# forkserver compiled torch, transformers and Composer from source again: the suite ran 68 min instead of 39.
# Then one process imports what the commands, the trainer, the servers and the tests' servers import, writing
# their bytecode (40 s cold on two cores): without it the suite's first minutes had every worker compile the same
# modules at once, and a refusal timed at under 10 s took 17 (CI-like run on 43df97a). What they import later
# (a model class, a migration) is written the first time it is.
export WARM_IMPORTS := import cli.main, cli.up, flows.pipeline, flows.continued, flows.evaluate, flows.prepare, \
	trainers.train, infra.launcher, infra.warm, evaluation, composer, streaming, prefect.server.api.server, \
	prefect.workers.process, mlflow.server, moto.server
$(STAMP): pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt -e ".[test,k8s]"
	$(BIN)/pip check
	$(BIN)/python -c "$$WARM_IMPORTS"
	touch $(STAMP)

demo: install
	$(BIN)/tessera run configs/tiny.yaml
	@echo
	@echo "Results:"
	@echo "  $(BIN)/tessera up    serves both UIs on this run's stores, with the deployments:"
	@echo "  Prefect http://127.0.0.1:4200 (flow runs, logs, artifacts), MLflow http://127.0.0.1:5000 (metrics, registry)"

# The formatter and linter first (seconds): a tree that does not pass them is not tested further.
test: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=25 -n $(TEST_WORKERS) --no-loadscope-reorder

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

# The browser suite (tests/test_ui.py): Debian's chromium clicking through the Prefect and MLflow UIs of
# `tessera up`. Not part of `make test`: Chromium comes from apt, not pip. Screenshots go to build/ui/.
test-ui: install
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt -e ".[test,k8s,ui]"
	@command -v chromium >/dev/null || { echo "make test-ui needs Debian's chromium: sudo apt-get install chromium"; exit 2; }
	TESSERA_UI_SHOTS=build/ui $(BIN)/python -m pytest -q -m ui

bench: install
	for b in bench/*.py; do $(BIN)/python $$b || exit 1; done

clean:
	rm -rf .tessera
