# Kiln: `make demo` and `make test` are all a new machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO_CKPT := engines/demo-checkpoint
DEMO_ENGINE := engines/demo

.PHONY: install demo test clean

install: $(VENV)/.installed

# torch is pinned to the CPU build kept on this machine's disk; the GPU machine brings its own.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: install
	$(BIN)/make-checkpoint --family llama3 --output $(DEMO_CKPT) --layers 2 --hidden-size 128 --force
	$(BIN)/build-engine --checkpoint $(DEMO_CKPT) --output $(DEMO_ENGINE) --dtype float32 \
		--max-seq-len 128 --max-num-tokens 128 --target cpu
	$(BIN)/run-engine --engine $(DEMO_ENGINE) --prompt "The kiln was hot" --prompt "Once upon a time" --max-tokens 24

test: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_CKPT) $(DEMO_ENGINE) *.egg-info
