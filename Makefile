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

# WHEELHOUSE=DIR: install offline from a folder of wheels (make wheelhouse), as the image does.
WHEELHOUSE ?=
ifneq ($(strip $(WHEELHOUSE)),)
export PIP_NO_INDEX := 1
export PIP_FIND_LINKS := $(abspath $(WHEELHOUSE))
export HVD_CACHE := $(abspath $(WHEELHOUSE))/hvd-cache
endif
# mpi4py's binary wheels (4.1 on) load the system's Open MPI or MPICH at import: no build.
MPI4PY_SPEC := mpi4py>=4.1,<5
WHEELHOUSE_OUT := docker/wheelhouse

.PHONY: install install-dependencies install-package system-packages test test-unit test-multiprocess test-cluster test-slurm demo bench bench-cluster soak docker wheelhouse clean

install: $(VENV)/.installed

# What the test suite needs beyond make install: iproute2 and util-linux for the emulated
# cluster, podman, runc and debootstrap for building the image where no Docker daemon runs,
# SLURM and munge for the SLURM stage. Their services are not started at install (policy-rc.d):
# the SLURM stage starts its own daemons inside the emulated nodes.
SYSTEM_TOOLS := ip:iproute2 tc:iproute2 unshare:util-linux podman:podman runc:runc \
  debootstrap:debootstrap slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge
system-packages:
	@missing=""; for tool in $(SYSTEM_TOOLS); do \
	  PATH="$$PATH:/usr/sbin:/sbin" command -v $${tool%%:*} >/dev/null || missing="$$missing $${tool##*:}"; done; \
	if [ -n "$$missing" ]; then echo "installing from Debian packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  policy=/usr/sbin/policy-rc.d; made=""; \
	  if [ ! -e $$policy ]; then printf '#!/bin/sh\nexit 101\n' | $$SUDO tee $$policy >/dev/null && $$SUDO chmod +x $$policy && made=1; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; status=$$?; \
	  [ -z "$$made" ] || $$SUDO rm -f $$policy; exit $$status; fi

# Two steps, so that an image rebuilds only the second when the library's code changes
# (docker/Dockerfile): the dependencies (OpenMPI, torch, mpi4py, the patched Horovod), then the
# package itself.
$(VENV)/.installed: $(VENV)/.dependencies-installed
	$(MAKE) -s install-package

$(VENV)/.dependencies-installed: setup.cfg pyproject.toml tools/build_horovod.sh tools/patch_horovod_rendezvous.py Makefile
	@command -v mpirun >/dev/null || { \
	  echo "installing OpenMPI from Debian packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq libopenmpi-dev openmpi-bin; }
	@[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)" numpy "cmake>=3.18,<4" packaging wheel "setuptools<81" pytest
	$(PY) -m pip install -q "$(MPI4PY_SPEC)"
	PYTHON=$(PY) bash tools/build_horovod.sh
	touch $@

install-dependencies: $(VENV)/.dependencies-installed

install-package:
	$(PY) -m pip install -q -e ".[test,examples]"
	$(VENV)/bin/horovodrun --check-build
	touch $(VENV)/.installed

test: install system-packages
	$(PY) tools/run_tests.py

test-cluster: install system-packages
	$(PY) tools/run_tests.py --cluster-only

# The SLURM stage alone (prints each job's final SLURM state)
test-slurm: install system-packages
	$(PY) tools/run_tests.py --slurm-only

test-unit: install
	$(PY) -m pytest -q tests/unit

test-multiprocess: install
	$(PY) tools/run_tests.py --multiprocess-only

# The main job on 2 emulated nodes x 2 ranks with a 16 Mbit/s link (one host where that is not
# possible); DEMO_ARGS go to tools/run_demo.py and the training script (e.g. --rate-mbit 100).
demo: install system-packages
	$(PY) tools/run_demo.py $(DEMO_ARGS)

# Single host (both controllers, 2 and 4 ranks), then the cluster section on 2 emulated nodes.
bench: install system-packages
	$(PY) bench/run.py --out results/bench

bench-cluster: install system-packages
	$(PY) bench/run.py --out results/bench --cluster-only

# The fault soak: an elastic job on 4 emulated nodes trained for 10 minutes through 20 faults
# drawn at random (SOAK_ARGS go to tools/soak.py, e.g. --seed 5); records in results/soak.
soak: install system-packages
	$(PY) tools/soak.py --minutes 10 --faults 20 --out results/soak $(SOAK_ARGS)

# Builds the CPU image with docker or podman (offline, from the wheelhouse), runs --check and the
# demo's fast mode inside it; OCI=path.tar also writes an OCI archive (for Apptainer).
docker: install system-packages
	$(PY) tools/docker_image.py $(if $(OCI),--oci $(OCI))

# Every wheel the image installs, built or fetched here (Horovod's from tools/build_horovod.sh's cache).
wheelhouse: install
	rm -rf $(WHEELHOUSE_OUT) && mkdir -p $(WHEELHOUSE_OUT)/hvd-cache
	cache="$${HVD_CACHE:-$${XDG_CACHE_HOME:-$$HOME/.cache}/hvd_averaging}"; \
	links=$$(for d in "$$cache"/wheels/*/; do printf -- '--find-links %s ' "$$d"; done); \
	$(PY) -m pip wheel -q -w $(WHEELHOUSE_OUT) $$links "$(TORCH_SPEC)" numpy "cmake>=3.18,<4" \
	  "$(MPI4PY_SPEC)" packaging wheel "setuptools<81" "setuptools>=61" pytest ".[test,examples]" && \
	cp -r "$$cache/wheels" $(WHEELHOUSE_OUT)/hvd-cache/
	rm -f $(WHEELHOUSE_OUT)/hvd_averaging-*.whl

clean:
	rm -rf $(VENV) build *.egg-info results .pytest_cache $(WHEELHOUSE_OUT)
