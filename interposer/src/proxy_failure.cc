#include "proxy_failure.h"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstring>
#include <utility>

#include "call_kinds.h"
#include "device_fault.h"
#include "proxy_functions.h"

namespace jitckpt {
namespace {

// A CUDA call's status that leaves the proxy's context unusable (an ncclResult_t is not one).
bool sticky_cuda_error(uint32_t tag, int32_t status) {
  if (status == 0) return false;
  const char* name = proxy::call_name(tag);
  if (name != nullptr && std::strncmp(name, "nccl", 4) == 0) return false;
  return is_device_fault(static_cast<cudaError_t>(status));
}

}  // namespace

std::string proxy_unusable(uint32_t tag, const proxy::CallResult& r, bool* device_fault, bool* earlier) {
  for (auto [t, status] : {std::pair<uint32_t, int32_t>{tag, r.status}, {r.async_call, r.async_status}}) {
    const char* name = proxy::call_name(t);
    const bool sticky = sticky_cuda_error(t, status);
    if (device_fault) *device_fault = sticky;
    if (earlier) *earlier = t == r.async_call && status == r.async_status && status != r.status;
    if (sticky)
      return std::string("the device got the sticky error ") + cudaGetErrorName(static_cast<cudaError_t>(status)) +
             " (in " + (name ? name : "?") + ")";
    if (proxy::communication_failed(name, status))
      return std::string("NCCL failed: ") + ncclGetErrorString(static_cast<ncclResult_t>(status)) + " (in " +
             (name ? name : "?") + ")";
  }
  return "";
}

}  // namespace jitckpt
