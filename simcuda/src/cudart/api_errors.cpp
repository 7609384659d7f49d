// cudaGetLastError / cudaPeekAtLastError / cudaGetErrorName / cudaGetErrorString.
#include "api_support.h"

using simcuda::Runtime;

namespace {
const char* error_name(cudaError_t e) {
  switch (static_cast<int>(e)) {
    case 0: return "cudaSuccess";
#define SIMCUDA_ERROR(name, value) \
  case value: return #name;
#include "error_names.inc"
#undef SIMCUDA_ERROR
    default: return nullptr;
  }
}

const char* error_description(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidPitchValue: return "invalid pitch argument";
    case cudaErrorInvalidSymbol: return "invalid device symbol";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorNoKernelImageForDevice: return "no kernel image is available for execution on the device";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorUnknown: return "unknown error";
    default: return nullptr;
  }
}
}  // namespace

SIMCUDA_API cudaError_t cudaGetLastError(void) { return Runtime::get().errors().take_last(); }
SIMCUDA_API cudaError_t cudaPeekAtLastError(void) { return Runtime::get().errors().peek_last(); }

SIMCUDA_API const char* cudaGetErrorName(cudaError_t error) {
  const char* n = error_name(error);
  return n ? n : "cudaErrorUnknown";
}

SIMCUDA_API const char* cudaGetErrorString(cudaError_t error) {
  if (const char* d = error_description(error)) return d;
  if (const char* n = error_name(error)) return n;  // simcuda has no prose for the rarer codes
  return "unrecognized error code";
}
