# Two entry points: `make demo` (the main job) and `make test` (the test suite).
# Each creates .venv and installs the project on first use, so a fresh clone needs only Python 3.11.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: demo test lint venv clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (set PYTHON=...)"; exit 1; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install -q -e ".[recipes,test]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) recipes/train_gpt.py $(DEMO_ARGS)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) tests/suite.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) outputs .pytest_cache
