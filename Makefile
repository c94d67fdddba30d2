# From a fresh clone with Python 3.10+ and the package index: `make demo` trains the digits recipe,
# `make test` runs the default suite. Each makes the virtual environment $(VENV) first, installs the
# pinned torch, then dtrain (editable) with its extras; a later call reuses what is installed.
#
#   make demo                  # CPU torch; TORCH=cuda: PyPI's Linux build for CUDA 13.0
#   make test                  # adds the test tools (the dev extra), then `pytest --durations=25`
#   make test-slow             # the long multi-process cases (`pytest -m slow`), as CI runs them after test

PYTHON ?= python3
VENV ?= .venv
TORCH ?= cpu
TORCH_VERSION := 2.13.0
# the CPU build comes from PyTorch's CPU index (PyPI's Linux wheel is the CUDA build, several GB more);
# its 2.13.0+cpu outranks PyPI's 2.13.0 for the same pin. Another CUDA: TORCH=cuda TORCH_INDEX=<its index>
TORCH_INDEX_cpu := https://download.pytorch.org/whl/cpu
TORCH_INDEX_cuda :=
TORCH_INDEX ?= $(TORCH_INDEX_$(TORCH))

ifeq ($(filter $(TORCH),cpu cuda),)
$(error TORCH=$(TORCH): expected cpu or cuda)
endif

VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
PYTEST := $(VENV_PYTHON) -m pytest --durations=25

.PHONY: demo test test-slow install install-dev

demo: install
	$(VENV_PYTHON) -m dtrain +recipe=digits

test: install-dev
	$(PYTEST)

# exit 5: no slow test collected
test-slow: install-dev
	$(PYTEST) -m slow || [ $$? -eq 5 ]

install: $(VENV)/.installed-demo
install-dev: $(VENV)/.installed-dev

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned: dtrain's bare `torch` requirement would pull PyPI's CUDA build; the stamp names
# the build, so switching TORCH reinstalls torch over the other one
$(VENV)/.torch-$(TORCH): | $(VENV_PYTHON)
	$(PIP) install --force-reinstall torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	rm -f $(VENV)/.torch-*
	touch $@

$(VENV)/.installed-demo: pyproject.toml $(VENV)/.torch-$(TORCH)
	$(PIP) install -e ".[mpi,tensorboard]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.torch-$(TORCH)
	$(PIP) install -e ".[dev]"
	touch $@
