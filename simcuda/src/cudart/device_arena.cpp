#include "device_arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace simcuda {
namespace {
size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ((n == 0 ? 1 : n) + page - 1) / page * page;
}
}  // namespace

DeviceArena::DeviceArena(int num_devices, size_t bytes_per_device, uintptr_t fixed_base)
    : num_devices_(num_devices), capacity_(bytes_per_device) {
  if (bytes_per_device > kRegionBytes)
    throw std::invalid_argument("simcuda: device memory larger than 64 GiB per device is not supported");
  const size_t total = reserved_bytes(num_devices);
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
  if (fixed_base != 0) flags |= MAP_FIXED_NOREPLACE;  // never over an existing mapping
  void* p = mmap(reinterpret_cast<void*>(fixed_base), total, PROT_NONE, flags, -1, 0);
  if (p == MAP_FAILED) {
    char what[160];
    std::snprintf(what, sizeof what, "simcuda: cannot reserve %zu GiB of device address space%s%#lx: %s",
                  total >> 30, fixed_base ? " at " : "", static_cast<unsigned long>(fixed_base),
                  std::strerror(errno));
    throw std::runtime_error(fixed_base ? what : "simcuda: cannot reserve device address space");
  }
  if (fixed_base != 0 && reinterpret_cast<uintptr_t>(p) != fixed_base) {  // a kernel before 4.17
    munmap(p, total);
    throw std::runtime_error("simcuda: the kernel placed the device arena elsewhere (MAP_FIXED_NOREPLACE "
                             "needs Linux 4.17)");
  }
  base_ = reinterpret_cast<uintptr_t>(p);
  for (int d = 0; d < num_devices; ++d) free_[d][region_base(d)] = kRegionBytes;
}

void* DeviceArena::allocate(int device, size_t size, bool managed) {
  const size_t len = page_round(size);
  std::lock_guard<std::mutex> lock(mu_);
  if (used_[device] + len > capacity_) return nullptr;
  auto& holes = free_[device];
  for (auto it = holes.begin(); it != holes.end(); ++it) {
    if (it->second < len) continue;
    const uintptr_t addr = it->first;
    const size_t rest = it->second - len;
    holes.erase(it);
    if (rest) holes[addr + len] = rest;
    if (mprotect(reinterpret_cast<void*>(addr), len, PROT_READ | PROT_WRITE) != 0) {
      holes[addr] = len;  // give it back; the caller sees an allocation failure
      return nullptr;
    }
    live_[addr] = DeviceAllocation{addr, size, device, managed};
    used_[device] += len;
    return reinterpret_cast<void*>(addr);
  }
  return nullptr;
}

bool DeviceArena::release(void* ptr) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(addr);
  if (it == live_.end()) return false;
  const size_t len = page_round(it->second.size);
  const int device = it->second.device;
  live_.erase(it);
  madvise(ptr, len, MADV_DONTNEED);
  mprotect(ptr, len, PROT_NONE);
  used_[device] -= len;
  auto& holes = free_[device];
  auto [pos, inserted] = holes.emplace(addr, len);
  (void)inserted;
  auto next = std::next(pos);  // coalesce with the following hole
  if (next != holes.end() && pos->first + pos->second == next->first) {
    pos->second += next->second;
    holes.erase(next);
  }
  if (pos != holes.begin()) {  // and with the preceding one
    auto prev = std::prev(pos);
    if (prev->first + prev->second == pos->first) {
      prev->second += pos->second;
      holes.erase(pos);
    }
  }
  return true;
}

std::optional<DeviceAllocation> DeviceArena::find(const void* ptr) const {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  if (addr < base_ || addr >= base_ + kRegionBytes * static_cast<size_t>(num_devices_)) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.upper_bound(addr);
  if (it == live_.begin()) return std::nullopt;
  --it;
  const size_t span = it->second.size == 0 ? 1 : it->second.size;
  if (addr >= it->first + span) return std::nullopt;
  return it->second;
}

bool DeviceArena::contains_range(const void* ptr, size_t len) const {
  auto a = find(ptr);
  if (!a) return false;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  return addr + len <= a->base + a->size;
}

bool DeviceArena::charge(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (used_[device] + bytes > capacity_) return false;
  used_[device] += bytes;
  return true;
}

void DeviceArena::refund(int device, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  used_[device] -= bytes;
}

size_t DeviceArena::used(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = used_.find(device);
  return it == used_.end() ? 0 : it->second;
}

}  // namespace simcuda
