// Validation and stream-ordered execution of memcpy / memset in every direction.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace simcuda {

// How a copy or memset relates to the host thread.
enum class HostSync {
  Async,  // cudaMemcpyAsync: returns after enqueueing (pageable sources are staged first)
  Sync,   // cudaMemcpy: returns when the copy has completed
};

struct CopyRequest {
  void* dst;
  const void* src;
  size_t count;
  cudaMemcpyKind kind;
  cudaStream_t stream;
  HostSync sync;
  bool per_thread_default;  // the _ptds/_ptsz entry points
};

cudaError_t copy_memory(const CopyRequest& req);

// 2-D copy: `height` rows of `width` bytes with the given pitches.
cudaError_t copy_memory_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                           cudaMemcpyKind kind, cudaStream_t stream, HostSync sync, bool per_thread_default);

cudaError_t set_memory(void* dst, int value, size_t count, cudaStream_t stream, HostSync sync,
                       bool per_thread_default);

}  // namespace simcuda
