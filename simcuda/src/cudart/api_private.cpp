// simcuda-only entry points used by simcuda's libnccl (version node SIMCUDA_PRIVATE, not CUDA API).
#include "api_support.h"

using simcuda::Runtime;

// Enqueues fn(data) on `stream` with the same ordering rules as any stream op. Unlike
// cudaLaunchHostFunc it is not interposed by tools that wrap the CUDA API.
SIMCUDA_API cudaError_t simcudaStreamEnqueue(cudaStream_t handle, void (*fn)(void*), void* data) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  auto s = rt.resolve_stream(handle, false);
  if (!s || !fn) return simcuda::api_result(cudaErrorInvalidResourceHandle);
  rt.device(s->device()).submit(s, [fn, data] { fn(data); });
  return cudaSuccess;
}

// Breaks the context with a sticky error (failure injection).
SIMCUDA_API void simcudaSetStickyError(cudaError_t error) { Runtime::get().errors().set_sticky(error); }
