VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test fuzz test-leaks bench lint docs docs-update check-layout clean

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml setup.py treemode/_guard.c
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_mlp.py

test: $(STAMP)
	$(PY) -m pytest -n 2 -q

# Property tests with the "fuzz" hypothesis profile (tests/conftest.py): 1,000
# random examples per test instead of CI's 20 derandomized ones (about an hour).
fuzz: $(STAMP)
	$(PY) -m pytest tests/test_properties.py -n 2 -q --hypothesis-profile=fuzz

# The whole suite with jax.check_tracer_leaks(True) around every test.
test-leaks: $(STAMP)
	$(PY) -m pytest -n 2 -q --tracer-leaks

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

# Rewrite the generated parts of the docs in place: the ```output blocks (the full
# error messages of docs/errors.md) and the tables made from benchmarks/results/.
docs-update: $(STAMP)
	UPDATE_DOCS=1 $(PY) -m pytest tests/test_docs.py -n 2 -q

# Every page of the built site fits a 1280 px window (headless Chromium; not run by
# .ci/run, which need not have a browser: run it after changing docs or their CSS).
check-layout: docs
	$(PY) tools/check_layout.py --site site --width 1280

clean:
	rm -rf $(VENV) build dist *.egg-info site
