# Quick start: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build from the machine's local wheel; the project's torch range then installs nothing more.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/hylo generate --chat --prompt "Hello from hylo! Tell me about hybrid attention." --max-tokens 48

test: $(STAMP) lint
	$(PY) -m pytest

lint: $(STAMP)
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
