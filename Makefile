# Kiln: `make demo` and `make test` are all a new machine needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO_CKPT := engines/demo-checkpoint
DEMO_ENGINE := engines/demo

ENGINE ?= $(DEMO_ENGINE)
# `make serve` starts tritonserver (triton) or the OpenAI-compatible serve-engine (openai).
SERVER ?= triton

# The tests with threads, processes and a server in them: `make test-repeat` runs them COUNT times
# in a row and stops at the first failure, to show they do not flake.
COUNT ?= 20
REPEAT_TESTS ?= tests/test_triton_server.py tests/test_triton_tp.py tests/test_session_batching.py \
	tests/test_session_requests.py tests/test_session_streaming.py tests/test_session_arguments.py \
	tests/test_session_fuzz.py \
	tests/test_tp_session.py tests/test_tensor_parallel.py \
	tests/test_openai_server.py tests/test_openai_load.py

.PHONY: install demo test test-repeat serve clean

install: $(VENV)/.installed

# torch is pinned to the CPU build kept on this machine's disk; the GPU machine brings its own.
# nvidia-pytriton is only there for the tritonserver binary inside its wheel: --no-deps keeps its
# Python API's dependencies (and their numpy 2) out. nvidia-cutlass is there for CUTLASS's C++
# headers (the CuTe GEMM nvcc builds); --no-deps keeps its Python generator's scipy and networkx out.
# The stamp depends on this Makefile too, so a changed install recipe is rerun in an existing .venv.
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps nvidia-pytriton==0.7.0
	$(PY) -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
	touch $@

demo: install
	$(BIN)/make-checkpoint --family llama3 --output $(DEMO_CKPT) --layers 2 --hidden-size 128 --force
	$(BIN)/build-engine --checkpoint $(DEMO_CKPT) --output $(DEMO_ENGINE) --dtype float32 \
		--max-seq-len 128 --max-num-tokens 128 --target cpu
	$(BIN)/run-engine --engine $(DEMO_ENGINE) --prompt "The kiln was hot" --prompt "Once upon a time" --max-tokens 24

# Serves ENGINE (default: the demo engine) on 127.0.0.1 through SERVER: a real tritonserver
# (triton, the default) or serve-engine's OpenAI API on port 8000 (openai); Ctrl-C stops it.
serve: install
	@case "$(SERVER)" in triton|openai) ;; *) echo "SERVER must be triton or openai, got '$(SERVER)'" >&2; exit 1;; esac
	@if [ ! -f $(ENGINE)/rank0.engine ]; then \
		if [ "$(ENGINE)" = "$(DEMO_ENGINE)" ]; then $(MAKE) demo; \
		else echo "$(ENGINE) has no rank0.engine: build it with build-engine, or run 'make serve' for the demo engine" >&2; exit 1; fi; \
	fi
	$(BIN)/$(if $(filter openai,$(SERVER)),serve-engine,serve-triton) --engine $(ENGINE)

# The suite runs in TEST_WORKERS processes (pytest-xdist), a test file to a worker so that its module
# fixtures (engines, converted checkpoints) are made once: on CI's 2 cores 12 minutes against 27 in one.
TEST_WORKERS ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-repeat: install
	@for i in $$(seq 1 $(COUNT)); do \
		start=$$(date +%s); \
		$(PY) -m pytest -q -x -p no:cacheprovider $(REPEAT_TESTS) || { echo "test-repeat: pass $$i of $(COUNT) failed" >&2; exit 1; }; \
		echo "test-repeat: pass $$i of $(COUNT) took $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf $(VENV) $(DEMO_CKPT) $(DEMO_ENGINE) *.egg-info
