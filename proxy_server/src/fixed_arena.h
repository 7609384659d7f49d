// The proxy's device memory at fixed addresses, through the driver's virtual memory management
// (cuMemAddressReserve at a chosen address, cuMemCreate, cuMemMap, cuMemSetAccess, found with
// cudaGetDriverEntryPointByVersion): the same sequence of cudaMalloc and cudaFree gives the same
// pointers in every proxy, so a new proxy replaying the journal hands the application the pointers
// it holds. Where the driver cannot give the fixed range, `usable()` is false, says why, and the
// proxy allocates with cudaMalloc (the job runs; a replay then finds its pointers differ and says so).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace jitckpt::proxy {

class FixedArena {
 public:
  // Device d's range starts at kBase + d * kDeviceStride (far from where Linux maps anything).
  static constexpr uint64_t kBase = 0x300000000000ULL;
  static constexpr uint64_t kDeviceStride = 1ULL << 40;

  FixedArena();  // resolves and reserves nothing yet: the first allocation does
  FixedArena(const FixedArena&) = delete;
  FixedArena& operator=(const FixedArena&) = delete;
  ~FixedArena();

  // False once the driver could not give the fixed range (or lacks the entry points); `why` says so.
  bool usable() const;
  std::string why() const;

  // cudaMalloc on the current device: cudaErrorMemoryAllocation when it does not fit, another
  // error with `why` set when the arena is unusable (the caller falls back to cudaMalloc).
  cudaError_t allocate(size_t size, void** ptr, std::string* why);
  // cudaFree of a pointer `allocate` returned; cudaErrorInvalidValue for any other.
  cudaError_t release(void* ptr, std::string* why);
  // Whether `ptr` is the base of one of its allocations.
  bool owns(const void* ptr) const;

 private:
  struct Region {
    uint64_t base = 0;
    uint64_t size = 0;
    size_t granularity = 0;
    std::map<uint64_t, uint64_t> holes;  // base -> length, first fit in address order
  };
  struct Driver;
  static const Driver* driver();  // nullptr when the driver lacks an entry point (it says which)
  Region* region(int device, std::string* why);  // reserved on first use; nullptr: unusable
  void disable(std::string why);

  const Driver* driver_ = nullptr;
  mutable std::mutex mu_;
  std::string why_;  // set once the arena is unusable
  std::map<int, Region> regions_;
  std::map<uint64_t, std::pair<uint64_t, int>> live_;  // base -> (mapped bytes, device)
};

}  // namespace jitckpt::proxy
