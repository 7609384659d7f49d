#!/usr/bin/env bash
# make sanitize: the native code under AddressSanitizer (+UBSan) and ThreadSanitizer.
# Per sanitizer, its own build tree of everything native (simcuda, libjit.so, the C++ unit tests),
# then: the GoogleTest unit tests, and the nvcc-built CUDA/NCCL programs of tests/native (real
# streams, cross-process NCCL, hangs, libjit.so's send logging and replay) run on the sanitized
# simcuda and libjit.so. Any sanitizer report fails the run, also in tests that expect a program
# to fail. Python is not run under a sanitizer (its own libraries are not built for one).
# Not test_proxy_host_register.py: a sanitizer's allocator puts its heap at the same fixed addresses
# in every process, so a registered heap buffer's address is always taken in the proxy as well, and
# proxy mode refuses the registration (clearly, as documented; see proxy_server/README.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${VPY:-.venv/bin/python}
# The venv's interpreter by its own path (not resolved through the symlink: the system python
# behind it lacks the venv's nvidia-nccl-cu13, where nccl.h comes from).
PY_ABS="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
JOBS=${JOBS:-2}
CXX_BIN=${CXX:-c++}
for san in ${SANITIZERS:-address thread}; do
  build=build/sanitize-$san
  case $san in
    address) runtime=$($CXX_BIN -print-file-name=libasan.so)
             # use_tls=0: GCC 12's LeakSanitizer misreads glibc's dynamic-TLS vector of
             # simcuda's threads and crashes in its tracer; the heap is still scanned.
             export ASAN_OPTIONS="log_path=$PWD/$build/reports/asan" \
               LSAN_OPTIONS="use_tls=0:suppressions=$PWD/tests/native/lsan.supp" ;;
    thread)  runtime=$($CXX_BIN -print-file-name=libtsan.so)
             export TSAN_OPTIONS="log_path=$PWD/$build/reports/tsan" ;;
    *) echo "unknown sanitizer $san (address or thread)" >&2; exit 2 ;;
  esac
  mkdir -p "$(dirname "$build")"  # a clean clone has no build/ yet
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DJITCKPT_SANITIZE="$san" \
      -DPython_EXECUTABLE="$PY_ABS" -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" \
      > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
  # Without the CUDA headers or nccl.h CMake builds no native part, and nothing would be tested.
  if grep -q "building without native components" "$build.configure.log"; then
    cat "$build.configure.log"; echo "$san: no native build (CUDA headers or nccl.h not found)" >&2; exit 1
  fi
  cmake --build "$build" -j"$JOBS"
  rm -rf "$build/reports"; mkdir -p "$build/reports"
  status=0
  # Transparent recovery relies on the device arena at its fixed address, so a new proxy hands out
  # the same pointers; ThreadSanitizer keeps that range for its shadow memory, so under it the replay
  # finds other pointers and refuses (as it should; proxy_process_test skips the arena test too).
  recovery_tests=""
  [ "$san" = address ] && recovery_tests=tests/native/test_transparent_recovery.py
  ctest --test-dir "$build" --output-on-failure -j"$JOBS" || status=$?
  JITCKPT_BUILD_DIR="$PWD/$build" JITCKPT_SANITIZER_RUNTIME="$runtime" \
    "$PY" -m pytest -q -p no:cacheprovider tests/native/test_simcuda_runtime.py \
      tests/native/test_simcuda_nccl.py tests/native/test_swift_nccl_logging.py tests/native/test_proxy_programs.py \
      tests/native/test_proxy_channels.py $recovery_tests \
      --deselect tests/native/test_swift_nccl_logging.py::test_python_api \
      --deselect tests/native/test_proxy_programs.py::test_jitckpt_run_transparent_no_python \
      --deselect tests/native/test_transparent_recovery.py::test_jitckpt_run_records_a_transparent_recovery_and_report_shows_its_breakdown \
      --deselect tests/native/test_transparent_recovery.py::test_replay_validation_catches_a_planted_nondeterminism_and_turns_recovery_off \
      || status=$?
  # A report is an error (ASan/LSan/UBSan "ERROR:" or "runtime error:", TSan "WARNING:
  # ThreadSanitizer:"); LeakSanitizer's own notes (e.g. "Unable to get registers from thread" when
  # it scans a process whose threads are exiting) are shown, not counted.
  if compgen -G "$build/reports/*" > /dev/null; then
    if grep -lE "ERROR: |runtime error:|WARNING: ThreadSanitizer:" "$build"/reports/* > /dev/null; then
      cat "$build"/reports/*; echo "$san sanitizer reports above ($build/reports)" >&2; exit 1
    fi
    echo "== $san: sanitizer notes, not errors:"; cat "$build"/reports/*
  fi
  [ "$status" = 0 ] || { echo "$san: tests failed" >&2; exit "$status"; }
  echo "== $san: unit tests and CUDA/NCCL programs clean"
  unset ASAN_OPTIONS LSAN_OPTIONS TSAN_OPTIONS
done
