VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test bench lint docs clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_mlp.py

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

# The benchmark suite: every case, all peers side by side; writes
# benchmarks/results/*.md, docs/assets/*.png and the results of docs/performance.md.
# `make bench BENCH_ARGS=--quick` for a fast run.
bench: $(STAMP)
	$(PIP) install --quiet -e '.[bench]'
	$(PY) benchmarks/run.py $(BENCH_ARGS)

lint: $(STAMP)
	$(PIP) install --quiet -e '.[dev]'
	$(VENV)/bin/ruff check treemode tests benchmarks examples
	$(VENV)/bin/ruff format --check treemode tests benchmarks examples
	$(VENV)/bin/pyright --pythonpath $(PY)

docs: $(STAMP)
	$(PIP) install --quiet -e '.[docs]'
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build dist *.egg-info site
