// Simulated device memory: one reserved address range per device, distinct from every host pointer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>

namespace simcuda {

// A live device allocation (cudaMalloc / cudaMallocManaged / cudaMallocAsync).
struct DeviceAllocation {
  uintptr_t base = 0;
  size_t size = 0;  // bytes requested
  int device = 0;
  bool managed = false;
};

// Reserves a large PROT_NONE range per device (no memory committed) and hands out page-aligned,
// read/write sub-ranges. Freed ranges go back to PROT_NONE so a kernel that touches freed memory
// faults instead of silently reading stale data.
//
// `fixed_base` != 0 reserves the range at exactly that address (MAP_FIXED_NOREPLACE) or throws:
// the role of cuMemAddressReserve at a chosen address on a GPU. Allocation is first-fit over an
// ordered free list, so the same sequence of allocations and frees gives the same addresses in
// every process: a restarted device proxy hands the application the pointers it had before.
class DeviceArena {
 public:
  DeviceArena(int num_devices, size_t bytes_per_device, uintptr_t fixed_base = 0);
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // nullptr when the device's simulated capacity is exhausted.
  void* allocate(int device, size_t size, bool managed);
  // false if `ptr` is not the base of a live allocation.
  bool release(void* ptr);
  // The allocation containing `ptr`, if any.
  std::optional<DeviceAllocation> find(const void* ptr) const;
  // True if [ptr, ptr+len) lies entirely inside one live allocation.
  bool contains_range(const void* ptr, size_t len) const;
  size_t capacity() const { return capacity_; }
  size_t used(int device) const;
  // Capacity taken by memory outside the arena (the driver's physical allocations, VirtualMemory):
  // false when it does not fit.
  bool charge(int device, size_t bytes);
  void refund(int device, size_t bytes);
  uintptr_t base() const { return base_; }
  // Bytes of address space the arena reserves for `num_devices` devices.
  static size_t reserved_bytes(int num_devices) { return kRegionBytes * static_cast<size_t>(num_devices); }

 private:
  static constexpr size_t kRegionBytes = size_t{1} << 36;  // 64 GiB of address space per device
  uintptr_t region_base(int device) const { return base_ + static_cast<uintptr_t>(device) * kRegionBytes; }

  uintptr_t base_ = 0;
  int num_devices_;
  size_t capacity_;
  mutable std::mutex mu_;
  std::map<uintptr_t, DeviceAllocation> live_;        // base -> allocation
  std::map<int, std::map<uintptr_t, size_t>> free_;  // device -> (offset base -> length), page granular
  std::map<int, size_t> used_;
};

}  // namespace simcuda
