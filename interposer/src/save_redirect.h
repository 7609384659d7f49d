// While the JIT save runs, device work the save path issues (copies, memsets, kernels, event records,
// synchronizations) is moved to a fresh non-blocking stream, so it does not queue behind the hung
// collective on the NCCL stream or on streams that wait for it (including the legacy default stream).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace jitckpt {

class SaveRedirect {
 public:
  bool active() const { return active_.load(std::memory_order_acquire); }
  cudaStream_t stream() const { return stream_; }

  // On the saving thread: make `device` current, create the fresh stream once, start redirecting.
  // Returns false (and redirects nothing) if the stream cannot be created.
  bool begin(int device);
  void end() { active_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> active_{false};
  cudaStream_t stream_ = nullptr;  // published by the release store of active_
};

}  // namespace jitckpt
