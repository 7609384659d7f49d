// nvcc's registration and launch ABI (__cuda*) and cudaLaunchKernel & friends.
#include <memory>

#include "api_support.h"
#include "kernel_launch.h"
#include "launch_config_stack.h"

using simcuda::api_result;
using simcuda::KernelEntry;
using simcuda::Runtime;

namespace simcuda {
std::vector<LaunchConfig>& launch_config_stack() {
  static thread_local std::vector<LaunchConfig> stack;
  return stack;
}
}  // namespace simcuda

namespace {
const KernelEntry* by_func(const void* func) {
  auto& reg = Runtime::get().kernels();
  if (const KernelEntry* k = reg.find_by_host_fun(func)) return k;
  return reg.find_by_handle(reinterpret_cast<cudaKernel_t>(const_cast<void*>(func)));
}
}  // namespace

// Each fat binary gets a handle slot; simcuda ignores the device code itself.
SIMCUDA_API void** __cudaRegisterFatBinary(void* fatCubin) {
  Runtime::get();  // initialize before main(), as libcudart does
  return new void*(fatCubin);
}
SIMCUDA_API void __cudaRegisterFatBinaryEnd(void**) {}
SIMCUDA_API void __cudaUnregisterFatBinary(void** handle) { delete handle; }
SIMCUDA_API char __cudaInitModule(void**) { return 1; }

SIMCUDA_API void __cudaRegisterFunction(void**, const char* hostFun, char* deviceFun, const char*, int, uint3*,
                                        uint3*, dim3*, dim3*, int*) {
  Runtime::get().kernels().register_function(hostFun, deviceFun);
}

// A __device__ variable gets zero-initialised device memory on device 0 (simcuda does not read the
// initial value out of the fat binary).
SIMCUDA_API void __cudaRegisterVar(void**, char* hostVar, char*, const char*, int, size_t size, int, int) {
  Runtime& rt = Runtime::get();
  void* dev = rt.arena().allocate(0, size, false);
  if (dev) rt.kernels().register_variable(hostVar, dev, size);
}
SIMCUDA_API void __cudaRegisterManagedVar(void**, void** hostVarPtrAddress, char*, const char*, int, size_t size,
                                          int, int) {
  Runtime& rt = Runtime::get();
  void* dev = rt.arena().allocate(0, size, true);
  if (dev) {
    rt.kernels().register_variable(hostVarPtrAddress, dev, size);
    *hostVarPtrAddress = dev;
  }
}

SIMCUDA_API unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, struct CUstream_st* stream) {
  simcuda::launch_config_stack().push_back(simcuda::LaunchConfig{grid, block, shmem, stream});
  return 0;
}

SIMCUDA_API cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shmem, void* stream) {
  auto& stack = simcuda::launch_config_stack();
  if (stack.empty()) return cudaErrorMissingConfiguration;
  const simcuda::LaunchConfig c = stack.back();
  stack.pop_back();
  *grid = c.grid;
  *block = c.block;
  *shmem = c.shared_mem;
  *static_cast<cudaStream_t*>(stream) = c.stream;
  return cudaSuccess;
}

SIMCUDA_API cudaError_t __cudaGetKernel(cudaKernel_t* out, const void* hostFun) {
  const KernelEntry* k = Runtime::get().kernels().find_by_host_fun(hostFun);
  if (!out || !k) return cudaErrorInvalidDeviceFunction;
  *out = reinterpret_cast<cudaKernel_t>(const_cast<KernelEntry*>(k));
  return cudaSuccess;
}

SIMCUDA_API cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shmem,
                                           cudaStream_t stream) {
  return simcuda::launch_kernel(Runtime::get().kernels().find_by_handle(kernel), grid, block, args, shmem, stream,
                                false);
}
SIMCUDA_API cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args,
                                                size_t shmem, cudaStream_t stream) {
  return simcuda::launch_kernel(Runtime::get().kernels().find_by_handle(kernel), grid, block, args, shmem, stream,
                                true);
}

SIMCUDA_API cudaError_t cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shmem,
                                         cudaStream_t stream) {
  return simcuda::launch_kernel(by_func(func), grid, block, args, shmem, stream, false);
}
SIMCUDA_API cudaError_t cudaLaunchKernel_ptsz(const void* func, dim3 grid, dim3 block, void** args, size_t shmem,
                                              cudaStream_t stream) {
  return simcuda::launch_kernel(by_func(func), grid, block, args, shmem, stream, true);
}
SIMCUDA_API cudaError_t cudaLaunchCooperativeKernel(const void* func, dim3 grid, dim3 block, void** args,
                                                    size_t shmem, cudaStream_t stream) {
  return simcuda::launch_kernel(by_func(func), grid, block, args, shmem, stream, false);
}
SIMCUDA_API cudaError_t cudaLaunchCooperativeKernel_ptsz(const void* func, dim3 grid, dim3 block, void** args,
                                                         size_t shmem, cudaStream_t stream) {
  return simcuda::launch_kernel(by_func(func), grid, block, args, shmem, stream, true);
}
SIMCUDA_API cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func, void** args) {
  if (!config) return api_result(cudaErrorInvalidValue);
  return simcuda::launch_kernel(by_func(func), config->gridDim, config->blockDim, args, config->dynamicSmemBytes,
                                config->stream, false);
}
SIMCUDA_API cudaError_t cudaLaunchKernelExC_ptsz(const cudaLaunchConfig_t* config, const void* func, void** args) {
  if (!config) return api_result(cudaErrorInvalidValue);
  return simcuda::launch_kernel(by_func(func), config->gridDim, config->blockDim, args, config->dynamicSmemBytes,
                                config->stream, true);
}

SIMCUDA_API cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!attr) return api_result(cudaErrorInvalidValue);
  if (!by_func(func)) return api_result(cudaErrorInvalidDeviceFunction);
  *attr = cudaFuncAttributes{};
  attr->maxThreadsPerBlock = 1024;
  attr->numRegs = 32;
  attr->ptxVersion = 90;
  attr->binaryVersion = 90;
  attr->maxDynamicSharedSizeBytes = 48 * 1024;
  return cudaSuccess;
}

// Parameter layout of a kernel (CUDA 12.4+): what an API-remoting client needs to pack a launch's
// arguments. A GPU reads it from the cubin's .nv.info; simcuda knows only each parameter's size
// (from the host kernel library), so it lays them out aligned to their size, capped at 8 bytes
// (a struct whose alignment is smaller than its size gets a larger offset than nvcc would give).
SIMCUDA_API cudaError_t cudaFuncGetParamInfo(const void* func, size_t paramIndex, size_t* paramOffset,
                                             size_t* paramSize) {
  SIMCUDA_RETURN_IF_STICKY();
  const KernelEntry* k = by_func(func);
  if (!k) return api_result(cudaErrorInvalidDeviceFunction);
  const simcuda_host_kernel* impl = Runtime::get().kernels().implementation(*k);
  if (!impl) return api_result(cudaErrorNoKernelImageForDevice);
  if (paramIndex >= impl->num_params || (!paramOffset && !paramSize)) return api_result(cudaErrorInvalidValue);
  size_t offset = 0;
  for (size_t i = 0;; ++i) {
    const size_t size = impl->param_sizes[i];
    size_t align = 1;
    while (align < 8 && size % (align * 2) == 0) align *= 2;
    offset = (offset + align - 1) / align * align;
    if (i == paramIndex) {
      if (paramOffset) *paramOffset = offset;
      if (paramSize) *paramSize = size;
      return cudaSuccess;
    }
    offset += size;
  }
}

SIMCUDA_API cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute, int) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(by_func(func) ? cudaSuccess : cudaErrorInvalidDeviceFunction);
}

SIMCUDA_API cudaError_t cudaKernelSetAttributeForDevice(cudaKernel_t kernel, cudaFuncAttribute, int, int) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().kernels().find_by_handle(kernel) ? cudaSuccess : cudaErrorInvalidDeviceFunction);
}

SIMCUDA_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void* func, int block,
                                                                               size_t, unsigned int) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!n || block <= 0) return api_result(cudaErrorInvalidValue);
  if (!by_func(func)) return api_result(cudaErrorInvalidDeviceFunction);
  *n = std::max(1, 2048 / block);
  return cudaSuccess;
}
SIMCUDA_API cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* n, const void* func, int block,
                                                                      size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n, func, block, smem, 0);
}
