// What a call is, from its name, where both sides of proxy mode must agree: libjit.so (which calls
// it journals and which failures it recovers from, issue 16) and the proxy (what runs while it is
// fenced after a failed NCCL call).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <cstring>

namespace jitckpt::proxy {

// A generated call that only reads state, never waiting for device work to change it: a query, a
// getter, a synchronize, an elapsed time.
inline bool reads_only(const char* name) {
  return name != nullptr && (std::strstr(name, "Query") != nullptr || std::strstr(name, "Get") != nullptr ||
                             std::strstr(name, "Synchronize") != nullptr || std::strstr(name, "ElapsedTime") != nullptr);
}

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
