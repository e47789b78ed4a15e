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

.PHONY: env native fio test deploy serve profile bench energy clean

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# the CPU wheel on disk first; a CUDA build otherwise costs several GB
	$(VENV)/bin/pip install -q torch==2.13.0 || $(VENV)/bin/pip install -q "torch>=2.4,<=2.14.1"
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $@

env: $(VENV)/.installed

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

test: native
	$(PYTHON) -m pytest -q

# PLATFORM=auto detects orin / rtx / smartssd, else local (the shipped fixture model)
deploy: native fio
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

profile: native fio
	$(PYTHON) -m edgekv.cli deploy --profile-only $(DEPLOY_ARGS)

clean:
	rm -rf $(VENV) deploy .pytest_cache
