// simcuda's libcuda.so.1: the driver entry points simcuda simulates, each found by name through
// cuGetProcAddress as on a GPU. The memory calls are the runtime's (its SIMCUDA_PRIVATE entry
// points), so mapped memory is device memory to copies, kernels and NCCL.
#include <cuda.h>

#include <cstring>

#define SIMCUDA_DRIVER_API extern "C" __attribute__((visibility("default")))

extern "C" {
CUresult simcudaMemAddressReserve(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult simcudaMemAddressFree(CUdeviceptr, size_t);
CUresult simcudaMemCreate(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*, unsigned long long);
CUresult simcudaMemRelease(CUmemGenericAllocationHandle);
CUresult simcudaMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult simcudaMemUnmap(CUdeviceptr, size_t);
CUresult simcudaMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
CUresult simcudaMemGetAllocationGranularity(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
int simcudaDeviceCount(void);
}

SIMCUDA_DRIVER_API CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

SIMCUDA_DRIVER_API CUresult cuDriverGetVersion(int* version) {
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = CUDA_VERSION;
  return CUDA_SUCCESS;
}

SIMCUDA_DRIVER_API CUresult cuDeviceGetCount(int* count) {
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = simcudaDeviceCount();
  return CUDA_SUCCESS;
}

SIMCUDA_DRIVER_API CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  if (device == nullptr || ordinal < 0 || ordinal >= simcudaDeviceCount()) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

SIMCUDA_DRIVER_API CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                                unsigned long long flags) {
  return simcudaMemAddressReserve(ptr, size, alignment, addr, flags);
}

SIMCUDA_DRIVER_API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { return simcudaMemAddressFree(ptr, size); }

SIMCUDA_DRIVER_API CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                                        const CUmemAllocationProp* prop, unsigned long long flags) {
  return simcudaMemCreate(handle, size, prop, flags);
}

SIMCUDA_DRIVER_API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) { return simcudaMemRelease(handle); }

SIMCUDA_DRIVER_API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                                     unsigned long long flags) {
  return simcudaMemMap(ptr, size, offset, handle, flags);
}

SIMCUDA_DRIVER_API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { return simcudaMemUnmap(ptr, size); }

SIMCUDA_DRIVER_API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  return simcudaMemSetAccess(ptr, size, desc, count);
}

SIMCUDA_DRIVER_API CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                                          CUmemAllocationGranularity_flags option) {
  return simcudaMemGetAllocationGranularity(granularity, prop, option);
}

SIMCUDA_DRIVER_API CUresult cuGetErrorName(CUresult error, const char** name) {
  if (name == nullptr) return CUDA_ERROR_INVALID_VALUE;
  switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_ILLEGAL_ADDRESS: *name = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
    case CUDA_ERROR_LAUNCH_FAILED: *name = "CUDA_ERROR_LAUNCH_FAILED"; break;
    default: *name = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
  return CUDA_SUCCESS;
}

SIMCUDA_DRIVER_API CUresult cuGetErrorString(CUresult error, const char** str) { return cuGetErrorName(error, str); }

namespace {

// Every entry point above with the CUDA version that introduced it (its ABI has not changed since).
struct Entry {
  const char* name;
  void* fn;
  int since;
};
const Entry kEntries[] = {
    {"cuInit", reinterpret_cast<void*>(&cuInit), 2000},
    {"cuDriverGetVersion", reinterpret_cast<void*>(&cuDriverGetVersion), 2020},
    {"cuDeviceGetCount", reinterpret_cast<void*>(&cuDeviceGetCount), 2000},
    {"cuDeviceGet", reinterpret_cast<void*>(&cuDeviceGet), 2000},
    {"cuGetErrorName", reinterpret_cast<void*>(&cuGetErrorName), 6000},
    {"cuGetErrorString", reinterpret_cast<void*>(&cuGetErrorString), 6000},
    {"cuMemAddressReserve", reinterpret_cast<void*>(&cuMemAddressReserve), 10020},
    {"cuMemAddressFree", reinterpret_cast<void*>(&cuMemAddressFree), 10020},
    {"cuMemCreate", reinterpret_cast<void*>(&cuMemCreate), 10020},
    {"cuMemRelease", reinterpret_cast<void*>(&cuMemRelease), 10020},
    {"cuMemMap", reinterpret_cast<void*>(&cuMemMap), 10020},
    {"cuMemUnmap", reinterpret_cast<void*>(&cuMemUnmap), 10020},
    {"cuMemSetAccess", reinterpret_cast<void*>(&cuMemSetAccess), 10020},
    {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&cuMemGetAllocationGranularity), 10020},
    {"cuGetProcAddress", nullptr, 12000},  // itself: filled in below
};

}  // namespace

// cuGetProcAddress is cuGetProcAddress_v2 in cuda.h (the v1 ABI, without the status, is not simulated).
SIMCUDA_DRIVER_API CUresult cuGetProcAddress(const char* symbol, void** pfn, int cudaVersion, cuuint64_t flags,
                                             CUdriverProcAddressQueryResult* symbolStatus) {
  if (symbol == nullptr || pfn == nullptr || cudaVersion > CUDA_VERSION) return CUDA_ERROR_INVALID_VALUE;
  *pfn = nullptr;
  CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  for (const Entry& e : kEntries) {
    if (std::strcmp(e.name, symbol) != 0) continue;
    if (cudaVersion < e.since) {
      status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      break;
    }
    *pfn = e.fn != nullptr ? e.fn : reinterpret_cast<void*>(&cuGetProcAddress);
    status = CU_GET_PROC_ADDRESS_SUCCESS;
    break;
  }
  if (symbolStatus != nullptr) *symbolStatus = status;
  return status == CU_GET_PROC_ADDRESS_SUCCESS ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
