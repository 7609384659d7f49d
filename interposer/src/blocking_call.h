// Marks the calling thread as inside a CUDA/NCCL call that can block indefinitely behind a hung
// collective (stream/device/event synchronization, synchronous copies, NCCL host calls). The GIL
// hand-off pre-empts a GIL holder only while it is in such a call, never while it runs Python.
// Initial-exec TLS: one store on the hot path, and safe to read from a signal handler.
#pragma once

namespace jitckpt {

class BlockingCallScope {
 public:
  BlockingCallScope() { ++depth_; }
  ~BlockingCallScope() { --depth_; }
  BlockingCallScope(const BlockingCallScope&) = delete;
  BlockingCallScope& operator=(const BlockingCallScope&) = delete;

  static bool active() { return depth_ > 0; }

 private:
  // Inline with a constant initializer: every TU sees it needs no dynamic init (no TLS wrapper call).
  static inline thread_local int depth_ __attribute__((tls_model("initial-exec"))) = 0;
};

}  // namespace jitckpt
