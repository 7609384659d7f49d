// simcuda-only entry points used by simcuda's libnccl (version node SIMCUDA_PRIVATE, not CUDA API).
#include "api_support.h"

using simcuda::Runtime;

// Enqueues fn(data) on `stream` with the same ordering rules as any stream op. Unlike
// cudaLaunchHostFunc it is not interposed by tools that wrap the CUDA API, and it runs even after a
// device fault (the callee owns `data` and must release it; it checks simcudaGetStickyError()).
SIMCUDA_API cudaError_t simcudaStreamEnqueue(cudaStream_t handle, void (*fn)(void*), void* data) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  auto s = rt.resolve_stream(handle, false);
  if (!s || !fn) return simcuda::api_result(cudaErrorInvalidResourceHandle);
  rt.device(s->device()).submit(s, [fn, data] { fn(data); }, /*always_run=*/true);
  return cudaSuccess;
}

// The context's sticky error (cudaSuccess while healthy).
SIMCUDA_API cudaError_t simcudaGetStickyError(void) { return Runtime::get().errors().sticky(); }

// Breaks the context with a sticky error (failure injection).
SIMCUDA_API void simcudaSetStickyError(cudaError_t error) { Runtime::get().errors().set_sticky(error); }
