VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test test-python fuzz test-leaks bench lint docs clean

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

# The whole suite again without the compiled extension (TREEMODE_NO_EXTENSION=1,
# docs/contributing.md): the pure-Python call path every user without a C
# compiler, or on a Flax/JAX the extension does not know, runs.
test-python: $(STAMP)
	TREEMODE_NO_EXTENSION=1 $(PY) -m pytest -n 2 -q

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

clean:
	rm -rf $(VENV) build dist *.egg-info site
