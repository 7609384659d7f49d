// The driver's virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap,
// cuMemSetAccess, ...) on the CPU: address ranges reserved PROT_NONE, physical allocations as memfds
// charged to their device's capacity, mappings of one into the other that kernels, copies and NCCL
// see as device memory once access is granted.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "device_arena.h"

namespace simcuda {

class VirtualMemory {
 public:
  // Physical memory is charged to `arena`'s per-device capacity, beside cudaMalloc's.
  VirtualMemory(DeviceArena* arena, int num_devices) : arena_(arena), num_devices_(num_devices) {}
  VirtualMemory(const VirtualMemory&) = delete;
  VirtualMemory& operator=(const VirtualMemory&) = delete;

  // Sizes, offsets and addresses are multiples of this (2 MiB, a GPU's usual granularity).
  static constexpr size_t kGranularity = size_t{2} << 20;

  // `addr` != 0 asks for that address; as on a GPU it is a hint: the range lands elsewhere when
  // it is taken, and the caller compares.
  CUresult reserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags);
  CUresult free_range(CUdeviceptr ptr, size_t size);
  CUresult create(CUmemGenericAllocationHandle* handle, size_t size, const CUmemAllocationProp* prop,
                  unsigned long long flags);
  CUresult release(CUmemGenericAllocationHandle handle);
  CUresult map(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
               unsigned long long flags);
  CUresult unmap(CUdeviceptr ptr, size_t size);
  CUresult set_access(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count);
  CUresult granularity(size_t* granularity, const CUmemAllocationProp* prop) const;

  // The accessible mapping containing `ptr`, as a device allocation (what copies and kernels check).
  std::optional<DeviceAllocation> find(const void* ptr) const;

 private:
  // Physical memory: freed (capacity refunded) when released and no longer mapped.
  struct Physical {
    Physical(int fd, size_t size, int device, DeviceArena* arena) : fd(fd), size(size), device(device), arena(arena) {}
    Physical(const Physical&) = delete;
    Physical& operator=(const Physical&) = delete;
    ~Physical();
    int fd;
    size_t size;
    int device;
    DeviceArena* arena;
  };
  struct Mapping {
    size_t size;
    std::shared_ptr<Physical> memory;
    bool accessible;
  };
  bool valid_prop(const CUmemAllocationProp* prop) const;
  // Whether [ptr, ptr + size) is whole mappings, end to end (what unmap and set_access take).
  bool whole_mappings(uintptr_t ptr, size_t size) const;
  // Whether [ptr, ptr + size) lies inside one reservation.
  bool reserved(uintptr_t ptr, size_t size) const;

  DeviceArena* arena_;
  int num_devices_;
  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> reservations_;  // base -> length
  std::map<CUmemGenericAllocationHandle, std::shared_ptr<Physical>> handles_;
  std::map<uintptr_t, Mapping> mappings_;  // base -> mapping
  CUmemGenericAllocationHandle next_handle_ = 0x5c0d0000;
};

}  // namespace simcuda
