// Page-locked ("pinned") host memory: cudaMallocHost/cudaHostAlloc allocations and cudaHostRegister'd
// ranges. On simcuda nothing is really locked; the registry exists so cudaPointerGetAttributes and
// cudaFreeHost behave like CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

namespace simcuda {

class PinnedHostRegistry {
 public:
  void* allocate(size_t size, unsigned flags);
  // false if `ptr` was not returned by allocate().
  bool release(void* ptr);
  // false if the range overlaps an already registered one.
  bool register_range(void* ptr, size_t size, unsigned flags);
  bool unregister_range(void* ptr);
  bool contains(const void* ptr) const;

 private:
  struct Range {
    size_t size;
    unsigned flags;
    bool owned;
  };
  mutable std::mutex mu_;
  std::map<uintptr_t, Range> ranges_;
};

}  // namespace simcuda
