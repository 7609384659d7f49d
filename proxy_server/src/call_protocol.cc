#include "call_protocol.h"

#include "proxy_functions.h"

namespace jitckpt::proxy {

const char* call_name(uint32_t call) {
  if (call >= kGenericBase) return function_name(call - kGenericBase);
  switch (static_cast<Call>(call)) {
    case Call::kMalloc: return "cudaMalloc";
    case Call::kFree: return "cudaFree";
    case Call::kMemcpyToDevice: return "cudaMemcpy(HostToDevice)";
    case Call::kMemcpyFromDevice: return "cudaMemcpy(DeviceToHost)";
    case Call::kRegisterKernel: return "kernel registration";
    case Call::kLaunchKernel: return "cudaLaunchKernel";
    case Call::kMemcpy: return "cudaMemcpy";
    case Call::kMemcpyAsync: return "cudaMemcpyAsync";
    case Call::kMemcpyToDeviceAsync: return "cudaMemcpyAsync(HostToDevice, pageable)";
    case Call::kMemcpyFromDeviceAsync: return "cudaMemcpyAsync(DeviceToHost, pageable)";
    case Call::kMemset: return "cudaMemset";
    case Call::kHostAlloc: return "cudaHostAlloc";
    case Call::kHostFree: return "cudaFreeHost";
    case Call::kKernelAttribute: return "kernel attribute";
    case Call::kRegisterModule: return "module registration";
    case Call::kCloseChannel: return "channel close";
    case Call::kSaveDevice: return "device memory save";
    case Call::kRestoreDevice: return "device memory restore";
    case Call::kFence: return "fence on NCCL failure";
  }
  return nullptr;
}

}  // namespace jitckpt::proxy
