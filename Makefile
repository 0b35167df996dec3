# The two commands of the README: `make demo` and `make test`. Everything else is a helper
# (`make demo-cell` shows a cell of three boxes on this machine).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo demo-cell test lint typecheck unit clean bundle real-engine-env test-real-engine

$(BIN)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11 or newer is needed (found " + sys.version.split()[0] + "); set PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

## demo: run the control plane on http://127.0.0.1:8080 with a dev state dir in ./.appliance/
demo: $(BIN)/.installed
	$(BIN)/python -m appliance.testing.demo

## demo-cell: a cell of three boxes here (a prefill head on :8080, two decode members on :8081, :8082; the real sglang-router), state in ./.appliance-cell/
demo-cell: $(BIN)/.installed
	$(BIN)/python -m appliance.testing.demo_cell

## test: everything CI checks (ruff, mypy strict, pytest with browser and database tests)
test: lint typecheck unit

lint: $(BIN)/.installed
	$(BIN)/ruff check appliance migrations tests benchmarks installer

typecheck: $(BIN)/.installed
	$(BIN)/mypy

# Two workers (CI's machine has two cores, and most tests wait on real processes), one test
# file each at a time so a file's module fixtures stay in one process; WORKERS=0 runs serially.
WORKERS ?= 2
unit: $(BIN)/.installed real-engine-env
	$(BIN)/pytest -q $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# The real-engine tier's environment (real SGLang 0.5.23 on CPU torch, tests/realengine/):
# built once into ~/.cache/appliance/ (or $$APPLIANCE_SGLANG_ENV) and reused in about a
# second after that. Without Python 3.11 it is skipped here, and the tier's tests skip
# (CI sets TEST_APPLIANCE_REQUIRE_REAL_ENGINE=1: there a missing env fails the tier).
real-engine-env:
	@if $(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then \
	  PYTHON=$(PYTHON) tests/realengine/build-env.sh >/dev/null; \
	elif [ -n "$$TEST_APPLIANCE_REQUIRE_REAL_ENGINE" ]; then \
	  echo "the real-engine tier needs Python 3.11 (set PYTHON=python3.11)" >&2; exit 1; \
	else echo "real-engine tier: no Python 3.11 here, its tests will skip" >&2; fi

## test-real-engine: only the real-engine tier (real SGLang 0.5.23 on CPU; builds its env first)
test-real-engine: $(BIN)/.installed real-engine-env
	$(BIN)/pytest -q -m real_engine $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

## bundle: the offline install tarball in dist/ (with the wheelhouse; build it on a box like the target)
bundle:
	installer/build-bundle.sh --python $(PYTHON)

clean:
	rm -rf $(VENV) .appliance .appliance-cell .mypy_cache .ruff_cache .pytest_cache
