// Which failed calls a new proxy may get past, where both sides of proxy mode must agree: libjit.so
// (which failures it recovers from, issue 16) and the proxy (when it fences after a failed NCCL
// call). What each generated call is (reads only, creates, work) is the generated table's
// (proxy_functions.h: function_kinds).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <cstring>

namespace jitckpt::proxy {

// NCCL's errors that say the communicator or the network failed, not the caller: a new proxy with
// new communicators may get past them. (ncclInvalidArgument/ncclInvalidUsage are the caller's.)
inline bool communication_failed(const char* name, int32_t status) {
  if (status == 0 || name == nullptr || std::strncmp(name, "nccl", 4) != 0) return false;
  switch (static_cast<ncclResult_t>(status)) {
    case ncclUnhandledCudaError:
    case ncclSystemError:
    case ncclInternalError:
    case ncclRemoteError:
      return true;
    default:
      return false;
  }
}

}  // namespace jitckpt::proxy
