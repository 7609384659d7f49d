#include "call_protocol.h"

namespace jitckpt::proxy {

const char* call_name(uint32_t call) {
  switch (static_cast<Call>(call)) {
    case Call::kGetDeviceCount: return "cudaGetDeviceCount";
    case Call::kGetDevice: return "cudaGetDevice";
    case Call::kSetDevice: return "cudaSetDevice";
    case Call::kMalloc: return "cudaMalloc";
    case Call::kFree: return "cudaFree";
    case Call::kMemcpyToDevice: return "cudaMemcpy(HostToDevice)";
    case Call::kMemcpyFromDevice: return "cudaMemcpy(DeviceToHost)";
    case Call::kDeviceSynchronize: return "cudaDeviceSynchronize";
  }
  return nullptr;
}

}  // namespace jitckpt::proxy
