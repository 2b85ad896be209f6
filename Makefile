# Two entry points that work on a fresh CPU machine with nothing but Python:
#   make demo   install, then a real supervised training run on the embedded corpus
#   make test   install, then the test suite
# On a GPU box the image brings its own CUDA torch: `make install TORCH=` skips the CPU wheel.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.m3run-installed

.PHONY: install demo test lint bench image-test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@if [ -n "$(TORCH)" ]; then $(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"; fi
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' -c ci-constraints.txt
	@touch $(STAMP)

demo: install
	$(PY) -m m3run.runner.demo

# Two test processes: on a 2-core machine the suite takes ~8 minutes instead of ~11. A module's
# tests stay in one process (--dist loadscope), so module-scoped runs are made once.
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -n 2 --dist loadscope

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: install
	$(PY) bench/kernels/bench_scan.py

# Builds the image from a CPU base and runs the demo in it with real signals (docker/README.md,
# "The image test"): needs podman or a Docker engine and root; not part of `test`.
# IMAGE_TEST_ARGS passes options on, e.g. IMAGE_TEST_ARGS='--base localhost/my-base'.
image-test:
	docker/test-image $(IMAGE_TEST_ARGS)

clean:
	rm -rf $(VENV) runs build *.egg-info
