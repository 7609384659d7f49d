# Two commands for a fresh machine: `make demo` and `make test`. Everything else is set up here.
PY        ?= python3
VENV      := .venv
VPY       := $(VENV)/bin/python
BUILD     := build/native
TORCH_SPEC ?= torch==2.13.0
NCCL_SPEC  ?= nvidia-nccl-cu13==2.30.7
JOBS      ?= 2

.PHONY: all venv native test test-slow demo bench clean wheel

all: native

venv: $(VENV)/.stamp
$(VENV)/.stamp: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)" "$(NCCL_SPEC)" psutil rich numpy google-crc32c xxhash pybind11 \
	    "scikit-build-core>=0.10" pytest pytest-timeout hypothesis matplotlib prometheus-client \
	    grpcio protobuf
	touch $@

native: venv
	mkdir -p build
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE=$(abspath $(VPY)) \
	    -Dpybind11_DIR=$$($(VPY) -m pybind11 --cmakedir) > $(BUILD).configure.log 2>&1 \
	    || { cat $(BUILD).configure.log; exit 1; }
	cmake --build $(BUILD) -j$(JOBS)

test: native
	$(VPY) -m pytest -q -ra

test-slow: native
	$(VPY) -m pytest -q -ra -m slow

demo: native
	$(VPY) -m jitckpt.demo

bench: native
	$(VPY) bench/run_all.py

wheel: venv
	$(VPY) -m pip wheel --no-deps -w dist .

clean:
	rm -rf build dist runs
