// Errors that mean the device (or its link) failed. On a GPU they are sticky: the CUDA context is
// unusable until it is destroyed. Observe mode reports them as failures (cuda_hooks.cc); proxy mode
// replaces the proxy that holds the context (proxy_session.cc). Other errors (bad handles, no
// device or driver) are the caller's and are returned as they are.
#pragma once

#include <cuda_runtime_api.h>

namespace jitckpt {

inline bool is_device_fault(cudaError_t e) {
  switch (e) {
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorExternalDevice:
      return true;
    default:
      return false;
  }
}

}  // namespace jitckpt
