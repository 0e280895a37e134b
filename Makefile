# Two entry points a newcomer needs: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint install

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/emberlink demo

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy emberlink
	$(BIN)/mypy tests
	$(BIN)/lint-imports

# pytest exits 5 when it collected no test: that is a failure here, not a pass.
# GPU tests (marker gpu) run on a CUDA machine: `python -m pytest -m gpu`.
test: lint
	$(BIN)/python -m pytest -q -m "not gpu"; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc
