// The proxy's side of a call: validates the request, runs it on the real CUDA runtime, and says
// what to reply. Device pointers are checked against the allocations this proxy handed out, so a
// stale or hostile pointer is an error, never a wild access.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "call_protocol.h"

namespace jitckpt::proxy {

class CallDispatcher {
 public:
  // Runs the request (`call`, `data`, `len` from the ring); fills `reply` (ReplyHead + results).
  void handle(uint32_t call, const uint8_t* data, size_t len, std::vector<uint8_t>* reply);

 private:
  bool owns(uint64_t ptr, uint64_t count) const;

  std::map<uint64_t, uint64_t> allocations_;  // device pointer -> bytes
};

}  // namespace jitckpt::proxy
