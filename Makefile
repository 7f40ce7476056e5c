# hvd_averaging: `make demo` (the main job) and `make test` (installs everything, runs the suite).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
NP ?= 4
# Multi-process runs: root is allowed (containers, CI), 4 ranks oversubscribe 2 cores.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: install test test-unit test-multiprocess demo bench docker clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml tools/build_horovod.sh Makefile
	@command -v mpirun >/dev/null || { \
	  echo "installing OpenMPI from Debian packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy "cmake>=3.18,<4" packaging wheel "setuptools<81" pytest
	$(PY) -m pip install -q --no-binary mpi4py mpi4py
	PYTHON=$(PY) bash tools/build_horovod.sh
	$(PY) -m pip install -q -e ".[test,examples]"
	$(VENV)/bin/horovodrun --check-build
	touch $@

test: install
	$(PY) tools/run_tests.py

test-unit: install
	$(PY) -m pytest -q tests/unit

test-multiprocess: install
	$(PY) tools/run_tests.py --multiprocess-only

demo: install
	$(VENV)/bin/horovodrun -np $(NP) $(PY) -m hvd_averaging.examples.train --out results/demo

bench: install
	$(PY) bench/run.py --out results/bench

docker:
	@if docker info >/dev/null 2>&1; then \
	  docker build -f docker/Dockerfile -t hvd_averaging:cpu . ; \
	else echo "make docker: no Docker engine reachable here (docker info failed); nothing was built"; exit 1; fi

clean:
	rm -rf $(VENV) build *.egg-info results .pytest_cache
