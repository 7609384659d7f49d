// Why a proxy's reply says the proxy's state is unusable, so that proxy mode replaces it (issue 16):
// a sticky CUDA error (its context is lost) or an NCCL failure a new proxy with new communicators
// may get past. An error the caller made (an invalid argument) is not one.
#pragma once

#include <cstdint>
#include <string>

#include "proxy_client.h"

namespace jitckpt {

// "" if the reply (its own status, or the earlier call's failure it reports) leaves the proxy
// usable. `device_fault`: the context is lost (else only communicators are, and the device memory
// can still be read). `earlier`: the failure is an earlier call's (ReplyHead::async_*).
std::string proxy_unusable(uint32_t tag, const proxy::CallResult& r, bool* device_fault = nullptr,
                           bool* earlier = nullptr);

}  // namespace jitckpt
