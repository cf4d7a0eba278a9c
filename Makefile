# Two commands do all setup on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# the package alone (what `make demo` needs); STAMP adds the dev tools (tests, lint) on top
RUN_STAMP := $(VENV)/.run-stamp
# npm packages of the JS conformance tests (conformance/js), installed by `make test` too
JS_STAMP := conformance/js/node_modules/.installed-stamp

.PHONY: demo test chaos fuzz conformance conformance-deps lint fmt bench bench-gateway bench-ab \
        bench-soak install clean

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
	  echo "reach-mesh needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) --version 2>/dev/null || \
	  echo 'not found'): name one, e.g. make $(or $(MAKECMDGOALS),demo) PYTHON=python3.12" >&2; \
	  exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(RUN_STAMP)
	$(VENV)/bin/reach-mesh demo

# make test                           the suite on TEST_WORKERS (2) processes (pytest-xdist); the
#                                     tests that start clusters of nats-servers run on one of them
# make test TEST_WORKERS=0            in this process, one test at a time
TEST_WORKERS ?= 2
test: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# make chaos                          every fault type, 1000 workflows each (docs/reliability.md)
# make chaos CHAOS_WORKFLOWS=200 CHAOS_FAULTS=node_kill,hub_kill
# make chaos CHAOS_SECURE=1             the same in secure mode (docs/security.md)
chaos: $(STAMP)
	CHAOS_WORKFLOWS=$(or $(CHAOS_WORKFLOWS),1000) CHAOS_FAULTS=$(CHAOS_FAULTS) \
	CHAOS_SECURE=$(CHAOS_SECURE) \
	CHAOS_OUT=$(or $(CHAOS_OUT),chaos-out) \
	$(PY) -m pytest -q -s -p no:cacheprovider -m chaos tests/chaos $(PYTEST_ARGS)

# make fuzz                           mutated and garbage input on every subject, 400 per
#                                     subject (the suite sends 40); FUZZ_SEED=n for another run
fuzz: $(STAMP)
	FUZZ_N=$(or $(FUZZ_N),400) FUZZ_SEED=$(or $(FUZZ_SEED),1) \
	$(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz_input.py $(PYTEST_ARGS)

# make conformance                    the JS agent and caller of conformance/js (written from the
#                                     protocol docs alone) against a hub and Python agents: the
#                                     short checks `make test` runs too, plus the long ones
#                                     (secure mode, restart, kill -9; ~25 s). Needs Node.js >= 18.
$(JS_STAMP): conformance/js/package-lock.json
	@if command -v node >/dev/null && command -v npm >/dev/null; then \
	  { npm ci --prefix conformance/js --no-audit --no-fund --loglevel=error && touch $@; } || \
	  echo "could not install conformance/js's npm packages: the JS conformance tests skip" >&2; \
	else echo "node/npm not found: the JS conformance tests skip (install Node.js >= 18)" >&2; fi

conformance-deps: $(JS_STAMP)

conformance: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest -q -rs -p no:cacheprovider -m 'not chaos' tests/test_conformance_js.py \
	  $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy reach_mesh tests

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# make bench            full run (writes bench/results/latest.json and docs/benchmarks.md)
# make bench QUICK=1    under a minute (writes bench/results/quick.json and quick.md only)
# make bench PROFILE=1  also profile the hub under the routed scenario
# make bench-gateway    only the HTTP gateway next to the NATS client and the floor (~2 minutes):
#                       the results' gateway section (latest.json, docs/benchmarks.md; QUICK=1: quick.*)
# make bench-ab BASE=rev [HEAD=rev] [ROUNDS=3]
#                       the workflow engine of two commits, alternated (bench/ab.py, ~4 minutes)
# make bench-soak [MINUTES=20]
#                       RSS of hub, agents and nats-server under steady mixed load (bench/soak.py;
#                       writes bench/results/soak.json)
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m bench $(if $(QUICK),--quick) $(if $(PROFILE),--profile)

bench-gateway: $(BENCH_STAMP)
	$(PY) -m bench --gateway $(if $(QUICK),--quick)

bench-ab: $(BENCH_STAMP)
	@test -n "$(BASE)" || { echo "make bench-ab BASE=<rev> [HEAD=<rev>] [ROUNDS=3]"; exit 2; }
	$(PY) -m bench.ab $(BASE) $(or $(HEAD),HEAD) --rounds $(or $(ROUNDS),3)

bench-soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(or $(MINUTES),20)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info conformance/js/node_modules
