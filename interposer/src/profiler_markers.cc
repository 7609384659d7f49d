// cudaProfilerStart/Stop (cuda_profiler_api.h, not in cuda_runtime_api.h, so not generated):
// passed to the real runtime in observe mode; no-ops in proxy mode, where no profiler is attached
// to the application process.
#include <cuda_runtime_api.h>

#include "next_symbol.h"
#include "proxy_forwarding.h"
#include "real_api.h"

#pragma GCC visibility push(default)
extern "C" {

cudaError_t cudaProfilerStart(void) {
  static jitckpt::NextSymbol<cudaError_t (*)()> next{"cudaProfilerStart", jitckpt::kCudartSoname};
  if (jitckpt::proxy_mode::session().enabled()) return cudaSuccess;
  auto fn = next.get();
  return fn ? fn() : jitckpt::proxy_mode::missing<cudaError_t>("cudaProfilerStart");
}

cudaError_t cudaProfilerStop(void) {
  static jitckpt::NextSymbol<cudaError_t (*)()> next{"cudaProfilerStop", jitckpt::kCudartSoname};
  if (jitckpt::proxy_mode::session().enabled()) return cudaSuccess;
  auto fn = next.get();
  return fn ? fn() : jitckpt::proxy_mode::missing<cudaError_t>("cudaProfilerStop");
}

}  // extern "C"
#pragma GCC visibility pop
