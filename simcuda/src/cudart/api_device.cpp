// Device management, properties, versions, limits, memory pools (pools are single and trivial).
#include <cstdio>
#include <cstring>

#include "api_support.h"

using simcuda::api_result;
using simcuda::Runtime;

namespace {
// One placeholder pool handle per device; simcuda allocates stream-ordered memory from the arena.
cudaMemPool_t pool_handle(int device) { return reinterpret_cast<cudaMemPool_t>(static_cast<uintptr_t>(0x5c0000 + device)); }
}  // namespace

SIMCUDA_API cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return api_result(cudaErrorInvalidValue);
  SIMCUDA_RETURN_IF_STICKY();
  *count = Runtime::get().device_count();
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaSetDevice(int device) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!rt.valid_device(device)) return api_result(cudaErrorInvalidDevice);
  rt.set_current_device(device);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaInitDevice(int device, unsigned int, unsigned int) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().valid_device(device) ? cudaSuccess : cudaErrorInvalidDevice);
}

SIMCUDA_API cudaError_t cudaGetDevice(int* device) {
  if (!device) return api_result(cudaErrorInvalidValue);
  SIMCUDA_RETURN_IF_STICKY();
  *device = Runtime::get().current_device();
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaSetDeviceFlags(unsigned int) { SIMCUDA_RETURN_IF_STICKY(); return cudaSuccess; }

SIMCUDA_API cudaError_t cudaGetDeviceFlags(unsigned int* flags) {
  if (!flags) return api_result(cudaErrorInvalidValue);
  *flags = 0;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!prop) return api_result(cudaErrorInvalidValue);
  if (!rt.valid_device(device)) return api_result(cudaErrorInvalidDevice);
  *prop = rt.device(device).properties();
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!value) return api_result(cudaErrorInvalidValue);
  if (!rt.valid_device(device)) return api_result(cudaErrorInvalidDevice);
  if (!rt.device(device).attribute(attr, value)) *value = 0;  // unsimulated attributes read as 0
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceSynchronize(void) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime::get().current().synchronize();
  return simcuda::after_wait();
}

SIMCUDA_API cudaError_t cudaDeviceReset(void) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime::get().current().synchronize();  // simcuda keeps allocations; see README
  return simcuda::after_wait();
}

SIMCUDA_API cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  SIMCUDA_RETURN_IF_STICKY();
  if (least) *least = 0;  // same range as current NVIDIA GPUs: 0 (lowest) .. -5 (highest)
  if (greatest) *greatest = -5;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!can) return api_result(cudaErrorInvalidValue);
  if (!rt.valid_device(device) || !rt.valid_device(peer)) return api_result(cudaErrorInvalidDevice);
  *can = device != peer ? 1 : 0;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().valid_device(peer) ? cudaSuccess : cudaErrorInvalidDevice);
}

SIMCUDA_API cudaError_t cudaDeviceDisablePeerAccess(int peer) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().valid_device(peer) ? cudaSuccess : cudaErrorInvalidDevice);
}

SIMCUDA_API cudaError_t cudaDeviceGetPCIBusId(char* id, int len, int device) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!id || len <= 0) return api_result(cudaErrorInvalidValue);
  if (!Runtime::get().valid_device(device)) return api_result(cudaErrorInvalidDevice);
  std::snprintf(id, static_cast<size_t>(len), "0000:%02x:00.0", device);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceGetByPCIBusId(int* device, const char* id) {
  SIMCUDA_RETURN_IF_STICKY();
  unsigned dom = 0, bus = 0;
  if (!device || !id || std::sscanf(id, "%x:%x", &dom, &bus) != 2) return api_result(cudaErrorInvalidValue);
  if (!Runtime::get().valid_device(static_cast<int>(bus))) return api_result(cudaErrorInvalidDevice);
  *device = static_cast<int>(bus);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDriverGetVersion(int* v) {
  if (!v) return api_result(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaRuntimeGetVersion(int* v) {
  if (!v) return api_result(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  const size_t cap = rt.arena().capacity(), used = rt.arena().used(rt.current_device());
  if (free_bytes) *free_bytes = cap - used;
  if (total) *total = cap;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceGetLimit(size_t* value, cudaLimit limit) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!value) return api_result(cudaErrorInvalidValue);
  switch (limit) {
    case cudaLimitStackSize: *value = 1024; break;
    case cudaLimitPrintfFifoSize: *value = 1 << 20; break;
    case cudaLimitMallocHeapSize: *value = 8 << 20; break;
    default: *value = 0;
  }
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceSetLimit(cudaLimit, size_t) { SIMCUDA_RETURN_IF_STICKY(); return cudaSuccess; }

SIMCUDA_API cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!pool) return api_result(cudaErrorInvalidValue);
  if (!Runtime::get().valid_device(device)) return api_result(cudaErrorInvalidDevice);
  *pool = pool_handle(device);
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceGetMemPool(cudaMemPool_t* pool, int device) {
  return cudaDeviceGetDefaultMemPool(pool, device);
}

SIMCUDA_API cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t, cudaMemPoolAttr attr, void* value) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!value) return api_result(cudaErrorInvalidValue);
  if (attr == cudaMemPoolReuseFollowEventDependencies || attr == cudaMemPoolReuseAllowOpportunistic ||
      attr == cudaMemPoolReuseAllowInternalDependencies)
    *static_cast<int*>(value) = 0;
  else
    *static_cast<uint64_t*>(value) = 0;  // thresholds and usage counters: simcuda pools hold nothing back
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void*) {
  SIMCUDA_RETURN_IF_STICKY();
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaMemPoolTrimTo(cudaMemPool_t, size_t) { SIMCUDA_RETURN_IF_STICKY(); return cudaSuccess; }
SIMCUDA_API cudaError_t cudaMemPoolSetAccess(cudaMemPool_t, const cudaMemAccessDesc*, size_t) {
  SIMCUDA_RETURN_IF_STICKY();
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaDeviceGetGraphMemAttribute(int, cudaGraphMemAttributeType, void* value) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!value) return api_result(cudaErrorInvalidValue);
  *static_cast<uint64_t*>(value) = 0;
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaDeviceSetGraphMemAttribute(int, cudaGraphMemAttributeType, void*) {
  SIMCUDA_RETURN_IF_STICKY();
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaProfilerStart(void) { return cudaSuccess; }
SIMCUDA_API cudaError_t cudaProfilerStop(void) { return cudaSuccess; }

