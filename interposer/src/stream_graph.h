// What libjit.so learns about the stream topology from intercepted calls, ProcessGroupNCCL style:
// the streams NCCL collectives run on, the events recorded on those streams, and the streams that
// wait on such events (they stall when a collective hangs). Lock-free on the hot path.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "stream_set.h"

namespace jitckpt {

class StreamGraph {
 public:
  void note_collective_stream(cudaStream_t s) { nccl_streams_.insert(s); }

  // cudaEventRecord(e, s): remember e if s is an NCCL stream, forget it otherwise (events are reused).
  void note_event_record(cudaEvent_t e, cudaStream_t s) {
    Slot& slot = slot_for(e);
    if (nccl_streams_.contains(s)) {
      slot.event.store(e, std::memory_order_release);
    } else if (slot.event.load(std::memory_order_relaxed) == e) {
      slot.event.store(nullptr, std::memory_order_release);
    }
  }

  // cudaStreamWaitEvent(s, e): s now depends on an NCCL stream if e was recorded on one.
  void note_stream_wait(cudaStream_t s, cudaEvent_t e) {
    if (slot_for(e).event.load(std::memory_order_acquire) == e && !nccl_streams_.contains(s))
      dependent_streams_.insert(s);
  }

  const StreamSet& nccl_streams() const { return nccl_streams_; }
  const StreamSet& dependent_streams() const { return dependent_streams_; }

 private:
  // Direct-mapped by event address: a collision just drops dependency information (status only).
  struct Slot {
    std::atomic<cudaEvent_t> event{nullptr};
  };
  static constexpr size_t kSlots = 1024;

  Slot& slot_for(cudaEvent_t e) {
    auto h = reinterpret_cast<uintptr_t>(e);
    return slots_[(h >> 4 ^ h >> 14) & (kSlots - 1)];
  }

  StreamSet nccl_streams_;
  StreamSet dependent_streams_;
  Slot slots_[kSlots];
};

}  // namespace jitckpt
