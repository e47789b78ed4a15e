# edgekv: `make deploy` runs the main job, `make test` the tests (see README.md).
PY        ?= python3
VENV      ?= .venv
PYTHON    := $(VENV)/bin/python
PLATFORM  ?= local
MODEL     ?=
KV_PATH   ?= deploy/$(PLATFORM)/kv

.PHONY: env native test deploy clean

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

test: native
	$(PYTHON) -m pytest -q

deploy: native
	$(PYTHON) -m edgekv.cli deploy --platform $(PLATFORM) --kv-path $(KV_PATH) $(if $(MODEL),--model $(MODEL))

clean:
	rm -rf $(VENV) deploy .pytest_cache
