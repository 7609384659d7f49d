// While the JIT save runs, device work the save path issues (copies, memsets, kernels, event records,
// synchronizations) is moved to a fresh non-blocking stream, so it does not queue behind the hung
// collective on the NCCL stream or on streams that wait for it (including the legacy default stream).
// Only threads marked as save threads are redirected: an application thread that reaches a
// synchronization on the hung stream after the failure must block there (and be parked by the GIL
// hand-off), not see a false success and run on with half-finished device work.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace jitckpt {

// Marks the calling thread as one that runs the save (the watchdog thread while the failure handler
// runs; a Python thread through jitckpt._native.set_save_thread). Nests.
class SaveThreadScope {
 public:
  SaveThreadScope() { ++depth_; }
  ~SaveThreadScope() { --depth_; }
  SaveThreadScope(const SaveThreadScope&) = delete;
  SaveThreadScope& operator=(const SaveThreadScope&) = delete;

  static bool marked() { return depth_ > 0; }
  // For callers that cannot hold a scope object across calls (the C ABI).
  static void set(bool on) { depth_ = on ? 1 : 0; }

 private:
  static inline thread_local int depth_ __attribute__((tls_model("initial-exec"))) = 0;
};

class SaveRedirect {
 public:
  bool active() const { return active_.load(std::memory_order_acquire); }
  // True if device work issued by the calling thread goes to the save stream now.
  bool applies_here() const { return active() && SaveThreadScope::marked(); }
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
