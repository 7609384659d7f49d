// Append-only, lock-free set of stream handles (few entries: the NCCL streams of a rank, and the
// streams that waited on them). Readers on the hot path scan without locking; inserts are rare.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <vector>

namespace jitckpt {

class StreamSet {
 public:
  static constexpr size_t kCapacity = 64;

  bool contains(cudaStream_t s) const {
    size_t n = size_.load(std::memory_order_acquire);
    for (size_t i = 0; i < n; ++i)
      if (slots_[i].load(std::memory_order_relaxed) == s) return true;
    return false;
  }

  // Returns false when full; the stream is then simply not tracked (status only, never correctness).
  bool insert(cudaStream_t s) {
    if (contains(s)) return true;
    std::lock_guard<std::mutex> lock(insert_mu_);  // never held across a CUDA call
    if (contains(s)) return true;
    size_t n = size_.load(std::memory_order_relaxed);
    if (n == kCapacity) return false;
    slots_[n].store(s, std::memory_order_relaxed);
    size_.store(n + 1, std::memory_order_release);
    return true;
  }

  std::vector<cudaStream_t> snapshot() const {
    size_t n = size_.load(std::memory_order_acquire);
    std::vector<cudaStream_t> out;
    for (size_t i = 0; i < n; ++i) out.push_back(slots_[i].load(std::memory_order_relaxed));
    return out;
  }

 private:
  std::atomic<cudaStream_t> slots_[kCapacity] = {};
  std::atomic<size_t> size_{0};
  std::mutex insert_mu_;
};

}  // namespace jitckpt
