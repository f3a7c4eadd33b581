# Two commands a new user needs (see README.md):
#   make run   - set up (idempotent) and run the main job on the tiny CPU default
#   make test  - set up (idempotent) and run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4

.PHONY: setup run test clean

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) pretrain_rlhf.py

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) *.egg-info
