# Two commands do all the set-up on a fresh machine:
#   make demo   - the main job: memory and time with and without remat
#   make test   - lint, types, every test, the doc examples, the notebooks, the docs build
# and one more on a machine with an NVIDIA GPU:
#   make gpu-check - the CUDA tests, offload and RNG, the bench on CUDA; a report
# and one that takes longer:
#   make compat    - every test on each supported torch (make compat TORCH=2.12.1: one)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DEPS := $(VENV)/.deps
PKG := $(VENV)/.pkg

.PHONY: demo test compat compat-venvs fuzz bench docs gpu-check clean

$(DEPS): requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

# Tests run against the installed package, not the source tree.
$(PKG): $(DEPS) pyproject.toml $(wildcard remat/*.py) remat/py.typed
	$(BIN)/pip install -q --no-deps --force-reinstall .
	touch $@

demo: $(PKG)
	$(BIN)/python benchmarks/demo.py

# tests/ also builds the docs site (mkdocs build --strict, which runs the notebooks:
# tests/test_site.py) and the sdist and wheel (tests/test_package.py).
test: $(PKG)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/pytest -n 2 tests
	$(BIN)/pytest --doctest-modules --pyargs remat

# The supported torch releases (docs/versions.md), each in its own venv under
# COMPAT_VENVS: requirements-dev.txt with the torch pin replaced (and the transformers
# pin, with TRANSFORMERS=5.17.0), made once and reused. The venv pins torch exactly,
# so a machine-wide pip constraints file must not veto the version asked for.
TORCH_VERSIONS := 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0
TORCH ?= $(TORCH_VERSIONS)
TRANSFORMERS ?=
COMPAT_VENVS ?= .venv-torch
WITH := $(if $(TRANSFORMERS),-transformers-$(TRANSFORMERS))
PINS = -e 's/^torch==.*/torch==$*/' \
	$(if $(TRANSFORMERS),-e 's/^transformers==.*/transformers==$(TRANSFORMERS)/')

$(COMPAT_VENVS)/torch-%$(WITH)/.deps: requirements-dev.txt
	$(PYTHON) -m venv $(@D)
	sed $(PINS) requirements-dev.txt > $(@D)/requirements.txt
	PIP_CONSTRAINT=/dev/null $(@D)/bin/pip install -q -r $(@D)/requirements.txt
	touch $@

$(COMPAT_VENVS)/torch-%$(WITH)/.pkg: $(COMPAT_VENVS)/torch-%$(WITH)/.deps pyproject.toml \
		$(wildcard remat/*.py) remat/py.typed
	$(@D)/bin/pip install -q --no-deps --force-reinstall .
	touch $@

compat-%: $(COMPAT_VENVS)/torch-%$(WITH)/.pkg
	$(COMPAT_VENVS)/torch-$*$(WITH)/bin/pytest -n 2 tests
	$(COMPAT_VENVS)/torch-$*$(WITH)/bin/pytest --doctest-modules --pyargs remat

compat: $(addprefix compat-,$(TORCH))

# The venvs alone, no test (CI makes them while make test runs).
compat-venvs: $(addsuffix $(WITH)/.deps,$(addprefix $(COMPAT_VENVS)/torch-,$(TORCH)))

.PRECIOUS: $(COMPAT_VENVS)/torch-%$(WITH)/.deps $(COMPAT_VENVS)/torch-%$(WITH)/.pkg

# The property tests with fresh examples, REMAT_FUZZ times as many (test draws fixed ones).
fuzz: $(PKG)
	REMAT_FUZZ=$${REMAT_FUZZ:-10} $(BIN)/pytest -n 2 -p no:cacheprovider tests/test_equivalence.py \
		tests/test_policy_equivalence.py tests/test_func.py

# The benchmark suite (about 18 minutes on 2 cores); results land in the docs. make gpu-check
# runs the same module with the GPU machine's Python (tools/gpu_check.py).
BENCH_OUT ?= docs/benchmarks
bench: $(PKG)
	$(BIN)/python -m benchmarks.suite --out $(BENCH_OUT)

# Notebooks run again only when they change (make test's build runs them every time).
docs: $(PKG)
	MKDOCS_JUPYTER_CACHE=true $(BIN)/mkdocs serve

# The checks that need an NVIDIA GPU (tools/gpu_check.py), with that machine's own Python and
# CUDA torch: the whole test suite, the CUDA tests among it, and the bench; report and logs in
# GPU_CHECK_OUT. It installs from GPU_WHEELS only, never from an index (such machines have no
# network). Without a GPU it says so and exits 0, before any set-up.
GPU_CHECK_OUT ?= build/gpu-check
GPU_WHEELS ?= .whl
# Some of the checks only, by name (cuda,other,bench,gpu-steps): a short lease runs cuda first.
GPU_CHECKS ?=
gpu-check:
	@if nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then \
		$(PYTHON) tools/gpu_check.py --out $(GPU_CHECK_OUT) --wheels $(GPU_WHEELS) \
			$(if $(GPU_CHECKS),--only $(GPU_CHECKS)); \
	else \
		echo "make gpu-check: skipped: no NVIDIA GPU on this machine (nvidia-smi -L lists none)."; \
		echo "With one, it runs the whole test suite (the CUDA tests among it) and the bench"; \
		echo "(memory from the CUDA allocator), and writes $(GPU_CHECK_OUT)/gpu-check-report.md."; \
	fi

# On a machine with network: the wheels make gpu-check installs (versions from
# requirements-dev.txt), for the GPU image's Python 3.12 on x86-64 Linux, into GPU_WHEELS.
.PHONY: gpu-wheels
gpu-wheels:
	$(PYTHON) tools/gpu_check.py --download --wheels $(GPU_WHEELS)

clean:
	rm -rf $(VENV) site .pytest_cache .ruff_cache .mypy_cache .hypothesis
