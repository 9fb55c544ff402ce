VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# What `make demo` installs (treemode, its runtime dependencies and the C
# extension, and optax for the demo's optimizer): a subset of $(STAMP)'s, so
# a venv that has the test extras has it too.
DEMO_STAMP := $(VENV)/.installed-demo
# The exact versions of the development environment; treemode itself declares
# ranges (pyproject.toml), tested at both ends by `make compat`.
CONSTRAINTS := -c constraints.txt

.PHONY: demo test test-python fuzz test-leaks bench lint docs docs-update check-layout dist wheels wheel-check compat clean

# pip, quietly: setuptools' notice about editable installs (a framed block on
# every `pip install -e`) is information, not a problem; real errors still show.
INSTALL := PYTHONWARNINGS="ignore:Editable installation" $(PIP) install --quiet --disable-pip-version-check

$(PY):
	python3 -m venv $(VENV)

# The compiled extension's sources: every C file and header of treemode/_accel/.
GUARD_SOURCES := $(wildcard treemode/_accel/*.c treemode/_accel/*.h)

$(STAMP): $(PY) pyproject.toml setup.py $(GUARD_SOURCES) constraints.txt
	$(INSTALL) --upgrade pip
	$(INSTALL) $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP) $(DEMO_STAMP)

# The first run installs only what the demo needs: not the test extra (pytest,
# hypothesis, pyright, build, equinox, ...) nor a pip upgrade, and without
# byte-compiling every installed file (--no-compile: JAX alone has thousands;
# Python compiles the modules the demo imports when it first imports them).
# Measured on a fresh clone (warm package cache, the shared 2-core machine at load
# 6 to 8): the first `make demo` took 54 to 70 s with the test extra, 33 to 51 s now.
# `make test` then installs the test extra into the same venv ($(STAMP) is
# still missing there).
$(DEMO_STAMP): $(PY) pyproject.toml setup.py $(GUARD_SOURCES) constraints.txt
	$(INSTALL) --no-compile $(CONSTRAINTS) -e . optax
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(PY) examples/train_mlp.py

test: $(STAMP)
	@echo "make test: the whole suite, about 5 minutes on 2 idle cores (2 pytest-xdist workers; tests/README.md)"
	$(PY) -m pytest -n 2 -q --durations=15

# The whole suite again without the compiled extension (TREEMODE_NO_EXTENSION=1,
# docs/contributing.md): the pure-Python call path every user without a C
# compiler, or on a Flax/JAX the extension does not know, runs.
test-python: $(STAMP)
	@echo "make test-python: the whole suite without the extension, about 5 minutes on 2 cores"
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
	$(INSTALL) $(CONSTRAINTS) -e '.[bench]'
	$(PY) benchmarks/run.py $(BENCH_ARGS)

# Flax's own tests/nnx with their transform calls routed to treemode (docs/conformance.md):
# tree mode, drop-in and Flax's forced tree mode, report in conformance/results/ (slow).
# `.ci/run` runs `make conformance CONFORMANCE_ARGS=--ci`: tree mode and the baseline check.
.PHONY: conformance
conformance: $(STAMP)
	$(INSTALL) cloudpickle  # imported by Flax's module_test.py
	$(PY) -m pytest -q -p no:randomly -p no:cacheprovider -n 0 conformance/test_harness.py
	$(PY) conformance/run.py $(CONFORMANCE_ARGS)

lint: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[dev]'
	$(VENV)/bin/ruff check treemode tests benchmarks examples tools conformance
	$(VENV)/bin/ruff format --check treemode tests benchmarks examples tools conformance
	$(VENV)/bin/pyright --pythonpath $(PY)

docs: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[docs]'
	$(VENV)/bin/mkdocs build --strict --site-dir site

# Rewrite the generated parts of the docs in place: the ```output blocks (the full
# error messages of docs/errors.md) and the tables made from benchmarks/results/.
docs-update: $(STAMP)
	UPDATE_DOCS=1 $(PY) -m pytest tests/test_docs.py -n 2 -q

# Every page of the built site fits a 1280 px window (headless Chromium; not run by
# .ci/run, which need not have a browser: run it after changing docs or their CSS).
check-layout: docs
	$(PY) tools/check_layout.py --site site --width 1280

# The sdist and the wheel into dist/, checked by twine (metadata, README rendering).
dist: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[dev]'
	rm -rf dist
	$(PY) -m build --quiet --outdir dist .
	$(VENV)/bin/twine check --strict dist/*

# The binary wheel (Linux): built, retagged manylinux_2_17 by `auditwheel repair`
# (and accepted by `auditwheel show`) into dist/wheelhouse/, installed into a
# fresh virtual environment with no C compiler on PATH, and the test suite run
# there against it with the extension active (tools/wheels.py; measured: 17
# minutes on a busy 2-core machine, 1475 passed). cibuildwheel builds the other platforms in the release workflow
# (.github/workflows/wheels.yml, [tool.cibuildwheel] in pyproject.toml).
# `make wheels WHEEL_TESTS="tests/test_jit.py"` runs a part of the suite.
WHEEL_TESTS ?= tests
wheels: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[dev]'
	$(PY) tools/wheels.py $(WHEEL_TESTS)

# What .ci/run does (the whole suite has just run from the checkout): the same
# wheel, tag and compiler-less installation checks, with the tests of the
# compiled call path and of the extension's status, and the examples (measured:
# 7 minutes on a busy 2-core machine, 1.5 to build and install, 4.6 for 340 tests).
# It runs a part of the suite, not all of it as `make wheels` does: the whole suite
# has just run from the checkout (make test), and again there would add about 10
# minutes to .ci/run. The part holds what the wheel's own environment changes:
# the compiled path and the extension's status, the versions, the examples, and
# the typing tests (pyright, a Node.js program, runs there with only `node` on PATH).
WHEEL_CHECK_TESTS := tests/test_extension.py tests/test_extension_inputs.py \
	tests/test_callsite.py tests/test_twins.py tests/test_flatten_cache.py \
	tests/test_replaced_objects.py tests/test_closure_helpers.py tests/test_compat.py \
	tests/test_versions.py tests/test_examples.py tests/test_typing.py
wheel-check: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[dev]'
	$(PY) tools/wheels.py $(WHEEL_CHECK_TESTS)

# The test suite of the sdist in fresh virtual environments under .compat/: the
# oldest supported versions, an environment with jax 0.9.2 + flax 0.12.6 that
# installing treemode must leave as it is, and the newest releases on Python
# 3.13, 3.12 and 3.11 (tools/compat.py). COMPAT_JOBS cases run at once.
# .ci/run: `make compat COMPAT_CASES=oldest,newest,newest-py3.12 COMPAT_JOBS=2`
# (the newest on 3.11 is what `make test` has just run).
COMPAT_CASES ?= oldest,middle,newest,newest-py3.12,newest-py3.11
COMPAT_JOBS ?= 1
compat: $(STAMP)
	$(INSTALL) $(CONSTRAINTS) -e '.[dev]'
	$(PY) tools/compat.py --cases $(COMPAT_CASES) --jobs $(COMPAT_JOBS)

clean:
	rm -rf $(VENV) build dist *.egg-info site .compat
