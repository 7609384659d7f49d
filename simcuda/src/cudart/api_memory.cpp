// Allocation, pointer attributes, memcpy/memset entry points, __device__ symbols.
#include <cstring>

#include "api_support.h"
#include "memory_copy.h"

using simcuda::api_result;
using simcuda::CopyRequest;
using simcuda::HostSync;
using simcuda::Runtime;

namespace {
cudaError_t device_malloc(void** ptr, size_t size, bool managed) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return api_result(cudaErrorInvalidValue);
  if (size == 0) {
    *ptr = nullptr;
    return cudaSuccess;
  }
  Runtime& rt = Runtime::get();
  void* p = rt.arena().allocate(rt.current_device(), size, managed);
  if (!p) return api_result(cudaErrorMemoryAllocation);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t copy(void* dst, const void* src, size_t n, cudaMemcpyKind kind, cudaStream_t s, HostSync sync,
                 bool ptds) {
  return simcuda::copy_memory(CopyRequest{dst, src, n, kind, s, sync, ptds});
}

cudaError_t symbol_address(const void* symbol, size_t offset, size_t count, char** out) {
  auto var = Runtime::get().kernels().find_variable(symbol);
  if (!var) return cudaErrorInvalidSymbol;
  if (offset + count > var->size) return cudaErrorInvalidValue;
  *out = static_cast<char*>(var->device_address) + offset;
  return cudaSuccess;
}
}  // namespace

SIMCUDA_API cudaError_t cudaMalloc(void** ptr, size_t size) { return device_malloc(ptr, size, false); }
SIMCUDA_API cudaError_t cudaMallocManaged(void** ptr, size_t size, unsigned int) { return device_malloc(ptr, size, true); }

SIMCUDA_API cudaError_t cudaFree(void* ptr) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return cudaSuccess;
  Runtime& rt = Runtime::get();
  rt.current().synchronize();  // cudaFree implicitly synchronizes the device, as in CUDA
  if (!rt.arena().release(ptr)) return api_result(cudaErrorInvalidValue);
  return simcuda::after_wait();
}

SIMCUDA_API cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!Runtime::get().resolve_stream(stream)) return api_result(cudaErrorInvalidResourceHandle);
  return device_malloc(ptr, size, false);
}
SIMCUDA_API cudaError_t cudaMallocAsync_ptsz(void** ptr, size_t size, cudaStream_t stream) {
  return cudaMallocAsync(ptr, size, stream);
}
SIMCUDA_API cudaError_t cudaMallocFromPoolAsync(void** ptr, size_t size, cudaMemPool_t, cudaStream_t stream) {
  return cudaMallocAsync(ptr, size, stream);
}

namespace {
cudaError_t free_async(void* ptr, cudaStream_t handle, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return cudaSuccess;
  Runtime& rt = Runtime::get();
  auto stream = rt.resolve_stream(handle, ptsz);
  if (!stream) return api_result(cudaErrorInvalidResourceHandle);
  if (!rt.arena().find(ptr)) return api_result(cudaErrorInvalidValue);
  rt.device(stream->device()).submit(stream, [ptr] { Runtime::get().arena().release(ptr); });
  return cudaSuccess;
}
}  // namespace
SIMCUDA_API cudaError_t cudaFreeAsync(void* ptr, cudaStream_t s) { return free_async(ptr, s, false); }
SIMCUDA_API cudaError_t cudaFreeAsync_ptsz(void* ptr, cudaStream_t s) { return free_async(ptr, s, true); }

SIMCUDA_API cudaError_t cudaMallocHost(void** ptr, size_t size) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return api_result(cudaErrorInvalidValue);
  *ptr = Runtime::get().pinned().allocate(size, 0);
  return *ptr ? cudaSuccess : api_result(cudaErrorMemoryAllocation);
}

SIMCUDA_API cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return api_result(cudaErrorInvalidValue);
  *ptr = Runtime::get().pinned().allocate(size, flags);
  return *ptr ? cudaSuccess : api_result(cudaErrorMemoryAllocation);
}

SIMCUDA_API cudaError_t cudaFreeHost(void* ptr) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr) return cudaSuccess;
  Runtime& rt = Runtime::get();
  rt.current().synchronize();
  return api_result(rt.pinned().release(ptr) ? cudaSuccess : cudaErrorInvalidValue);
}

SIMCUDA_API cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!ptr || size == 0) return api_result(cudaErrorInvalidValue);
  return api_result(Runtime::get().pinned().register_range(ptr, size, flags) ? cudaSuccess
                                                                          : cudaErrorHostMemoryAlreadyRegistered);
}

SIMCUDA_API cudaError_t cudaHostUnregister(void* ptr) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().pinned().unregister_range(ptr) ? cudaSuccess : cudaErrorHostMemoryNotRegistered);
}

SIMCUDA_API cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned int) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!dev || !Runtime::get().pinned().contains(host)) return api_result(cudaErrorInvalidValue);
  *dev = host;  // mapped pinned memory has the same address on host and device (UVA)
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!attr) return api_result(cudaErrorInvalidValue);
  Runtime& rt = Runtime::get();
  std::memset(attr, 0, sizeof(*attr));
  attr->device = -2;  // what CUDA reports for unregistered host memory
  if (auto a = rt.find_device(ptr)) {
    attr->type = a->managed ? cudaMemoryTypeManaged : cudaMemoryTypeDevice;
    attr->device = a->device;
    attr->devicePointer = const_cast<void*>(ptr);
    attr->hostPointer = a->managed ? const_cast<void*>(ptr) : nullptr;
  } else if (rt.pinned().contains(ptr)) {
    attr->type = cudaMemoryTypeHost;
    attr->device = rt.current_device();
    attr->devicePointer = const_cast<void*>(ptr);
    attr->hostPointer = const_cast<void*>(ptr);
  } else {
    attr->type = cudaMemoryTypeUnregistered;
  }
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  return copy(d, s, n, k, nullptr, HostSync::Sync, false);
}
SIMCUDA_API cudaError_t cudaMemcpy_ptds(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  return copy(d, s, n, k, nullptr, HostSync::Sync, true);
}
SIMCUDA_API cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
  return copy(d, s, n, k, st, HostSync::Async, false);
}
SIMCUDA_API cudaError_t cudaMemcpyAsync_ptsz(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
  return copy(d, s, n, k, st, HostSync::Async, true);
}
SIMCUDA_API cudaError_t cudaMemcpyPeer(void* d, int, const void* s, int, size_t n) {
  return copy(d, s, n, cudaMemcpyDeviceToDevice, nullptr, HostSync::Sync, false);
}
SIMCUDA_API cudaError_t cudaMemcpyPeerAsync(void* d, int, const void* s, int, size_t n, cudaStream_t st) {
  return copy(d, s, n, cudaMemcpyDeviceToDevice, st, HostSync::Async, false);
}
SIMCUDA_API cudaError_t cudaMemcpy2D(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                                     cudaMemcpyKind k) {
  return simcuda::copy_memory_2d(d, dp, s, sp, w, h, k, nullptr, HostSync::Sync, false);
}
SIMCUDA_API cudaError_t cudaMemcpy2D_ptds(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                                          cudaMemcpyKind k) {
  return simcuda::copy_memory_2d(d, dp, s, sp, w, h, k, nullptr, HostSync::Sync, true);
}
SIMCUDA_API cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                                          cudaMemcpyKind k, cudaStream_t st) {
  return simcuda::copy_memory_2d(d, dp, s, sp, w, h, k, st, HostSync::Async, false);
}
SIMCUDA_API cudaError_t cudaMemcpy2DAsync_ptsz(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h,
                                               cudaMemcpyKind k, cudaStream_t st) {
  return simcuda::copy_memory_2d(d, dp, s, sp, w, h, k, st, HostSync::Async, true);
}

SIMCUDA_API cudaError_t cudaMemset(void* p, int v, size_t n) {
  return simcuda::set_memory(p, v, n, nullptr, HostSync::Sync, false);
}
SIMCUDA_API cudaError_t cudaMemset_ptds(void* p, int v, size_t n) {
  return simcuda::set_memory(p, v, n, nullptr, HostSync::Sync, true);
}
SIMCUDA_API cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t s) {
  return simcuda::set_memory(p, v, n, s, HostSync::Async, false);
}
SIMCUDA_API cudaError_t cudaMemsetAsync_ptsz(void* p, int v, size_t n, cudaStream_t s) {
  return simcuda::set_memory(p, v, n, s, HostSync::Async, true);
}

SIMCUDA_API cudaError_t cudaGetSymbolAddress(void** dev, const void* symbol) {
  SIMCUDA_RETURN_IF_STICKY();
  char* p = nullptr;
  if (!dev) return api_result(cudaErrorInvalidValue);
  if (cudaError_t e = symbol_address(symbol, 0, 0, &p); e != cudaSuccess) return api_result(e);
  *dev = p;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGetSymbolSize(size_t* size, const void* symbol) {
  SIMCUDA_RETURN_IF_STICKY();
  auto var = Runtime::get().kernels().find_variable(symbol);
  if (!size) return api_result(cudaErrorInvalidValue);
  if (!var) return api_result(cudaErrorInvalidSymbol);
  *size = var->size;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaMemcpyToSymbol(const void* symbol, const void* src, size_t n, size_t offset,
                                           cudaMemcpyKind kind) {
  SIMCUDA_RETURN_IF_STICKY();
  char* p = nullptr;
  if (cudaError_t e = symbol_address(symbol, offset, n, &p); e != cudaSuccess) return api_result(e);
  return copy(p, src, n, kind == cudaMemcpyDefault ? cudaMemcpyDefault : kind, nullptr, HostSync::Sync, false);
}

SIMCUDA_API cudaError_t cudaMemcpyFromSymbol(void* dst, const void* symbol, size_t n, size_t offset,
                                             cudaMemcpyKind kind) {
  SIMCUDA_RETURN_IF_STICKY();
  char* p = nullptr;
  if (cudaError_t e = symbol_address(symbol, offset, n, &p); e != cudaSuccess) return api_result(e);
  return copy(dst, p, n, kind, nullptr, HostSync::Sync, false);
}

SIMCUDA_API cudaError_t cudaMemcpyToSymbolAsync(const void* symbol, const void* src, size_t n, size_t offset,
                                                cudaMemcpyKind kind, cudaStream_t st) {
  SIMCUDA_RETURN_IF_STICKY();
  char* p = nullptr;
  if (cudaError_t e = symbol_address(symbol, offset, n, &p); e != cudaSuccess) return api_result(e);
  return copy(p, src, n, kind, st, HostSync::Async, false);
}
