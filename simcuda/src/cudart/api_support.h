// Helpers shared by the extern "C" entry points (api_*.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include "runtime.h"

#define SIMCUDA_API extern "C" __attribute__((visibility("default")))

// A broken (sticky-faulted) context fails every call with its sticky error.
#define SIMCUDA_RETURN_IF_STICKY()                                                         \
  do {                                                                                     \
    if (cudaError_t sticky_ = ::simcuda::Runtime::get().errors().sticky(); sticky_ != cudaSuccess) \
      return sticky_;                                                                      \
  } while (0)

namespace simcuda {

// Records `e` as the calling thread's last error and returns it.
inline cudaError_t api_result(cudaError_t e) { return Runtime::get().errors().record(e); }

// After a host-blocking wait, a fault that happened meanwhile must be reported.
inline cudaError_t after_wait() {
  cudaError_t s = Runtime::get().errors().sticky();
  return s != cudaSuccess ? s : cudaSuccess;
}

}  // namespace simcuda
