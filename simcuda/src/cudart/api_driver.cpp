// The runtime's way to the driver (cudaGetDriverEntryPoint*), and the driver's virtual memory
// management that simcuda's libcuda.so.1 exports (version node SIMCUDA_PRIVATE: its cuMem* entry
// points call these, so that mapped memory is the runtime's device memory).
#include <cuda.h>
#include <dlfcn.h>

#include <string>

#include "api_support.h"

using simcuda::Runtime;

namespace {

// A broken context fails driver calls too, with the same number (CUDA's runtime and driver codes
// agree for the sticky errors: 700 illegal address, 719 launch failure, ...).
#define SIMCUDA_DRIVER_RETURN_IF_STICKY()                                                          \
  do {                                                                                             \
    if (cudaError_t sticky_ = Runtime::get().errors().sticky(); sticky_ != cudaSuccess)            \
      return static_cast<CUresult>(sticky_);                                                       \
  } while (0)

using GetProcAddress = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

// simcuda's libcuda.so.1, the one beside this library (not whatever libcuda.so.1 the loader finds
// first: a GPU machine's driver must never pair with the simulated runtime).
GetProcAddress driver_get_proc_address() {
  static GetProcAddress fn = [] () -> GetProcAddress {
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&driver_get_proc_address), &info) == 0 || info.dli_fname == nullptr)
      return nullptr;
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.rfind('/') + 1);
    void* lib = dlopen((dir + "libcuda.so.1").c_str(), RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<GetProcAddress>(dlsym(lib, "cuGetProcAddress_v2")) : nullptr;
  }();
  return fn;
}

cudaError_t entry_point(const char* symbol, void** funcPtr, int cudaVersion, unsigned long long flags,
                        cudaDriverEntryPointQueryResult* driverStatus) {
  if (symbol == nullptr || funcPtr == nullptr) return simcuda::api_result(cudaErrorInvalidValue);
  *funcPtr = nullptr;
  GetProcAddress get = driver_get_proc_address();
  if (get == nullptr) return simcuda::api_result(cudaErrorNotSupported);
  CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  const CUresult r = get(symbol, funcPtr, cudaVersion, flags, &found);
  if (driverStatus != nullptr)
    *driverStatus = found == CU_GET_PROC_ADDRESS_SUCCESS ? cudaDriverEntryPointSuccess
                    : found == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT ? cudaDriverEntryPointVersionNotSufficent
                                                                         : cudaDriverEntryPointSymbolNotFound;
  // A symbol the driver lacks is a success with a null pointer; a version above the driver's is not.
  return r == CUDA_ERROR_INVALID_VALUE ? simcuda::api_result(cudaErrorInvalidValue) : cudaSuccess;
}

}  // namespace

SIMCUDA_API cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr, unsigned int cudaVersion,
                                                         unsigned long long flags,
                                                         cudaDriverEntryPointQueryResult* driverStatus) {
  return entry_point(symbol, funcPtr, static_cast<int>(cudaVersion), flags, driverStatus);
}

SIMCUDA_API cudaError_t cudaGetDriverEntryPointByVersion_ptsz(const char* symbol, void** funcPtr,
                                                              unsigned int cudaVersion, unsigned long long flags,
                                                              cudaDriverEntryPointQueryResult* driverStatus) {
  return entry_point(symbol, funcPtr, static_cast<int>(cudaVersion), flags, driverStatus);
}

// The deprecated form: the symbol as of the runtime's own version.
SIMCUDA_API cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** funcPtr, unsigned long long flags,
                                                cudaDriverEntryPointQueryResult* driverStatus) {
  return entry_point(symbol, funcPtr, CUDART_VERSION, flags, driverStatus);
}

SIMCUDA_API cudaError_t cudaGetDriverEntryPoint_ptsz(const char* symbol, void** funcPtr, unsigned long long flags,
                                                     cudaDriverEntryPointQueryResult* driverStatus) {
  return entry_point(symbol, funcPtr, CUDART_VERSION, flags, driverStatus);
}

SIMCUDA_API CUresult simcudaMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                              unsigned long long flags) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().reserve(ptr, size, alignment, addr, flags);
}

SIMCUDA_API CUresult simcudaMemAddressFree(CUdeviceptr ptr, size_t size) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().free_range(ptr, size);
}

SIMCUDA_API CUresult simcudaMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                      const CUmemAllocationProp* prop, unsigned long long flags) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().create(handle, size, prop, flags);
}

SIMCUDA_API CUresult simcudaMemRelease(CUmemGenericAllocationHandle handle) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().release(handle);
}

SIMCUDA_API CUresult simcudaMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                   unsigned long long flags) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().map(ptr, size, offset, handle, flags);
}

SIMCUDA_API CUresult simcudaMemUnmap(CUdeviceptr ptr, size_t size) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().unmap(ptr, size);
}

SIMCUDA_API CUresult simcudaMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  SIMCUDA_DRIVER_RETURN_IF_STICKY();
  return Runtime::get().virtual_memory().set_access(ptr, size, desc, count);
}

SIMCUDA_API CUresult simcudaMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                        CUmemAllocationGranularity_flags option) {
  return Runtime::get().virtual_memory().granularity(granularity, prop);
}

SIMCUDA_API int simcudaDeviceCount(void) { return Runtime::get().device_count(); }
