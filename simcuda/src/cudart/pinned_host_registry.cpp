#include "pinned_host_registry.h"

#include <cstdlib>

namespace simcuda {

void* PinnedHostRegistry::allocate(size_t size, unsigned flags) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, size == 0 ? 1 : size) != 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  ranges_[reinterpret_cast<uintptr_t>(p)] = Range{size == 0 ? 1 : size, flags, true};
  return p;
}

bool PinnedHostRegistry::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == ranges_.end() || !it->second.owned) return false;
  ranges_.erase(it);
  std::free(ptr);
  return true;
}

bool PinnedHostRegistry::register_range(void* ptr, size_t size, unsigned flags) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto next = ranges_.lower_bound(addr);
  if (next != ranges_.end() && next->first < addr + size) return false;
  if (next != ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > addr) return false;
  }
  ranges_[addr] = Range{size, flags, false};
  return true;
}

bool PinnedHostRegistry::unregister_range(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == ranges_.end() || it->second.owned) return false;
  ranges_.erase(it);
  return true;
}

bool PinnedHostRegistry::contains(const void* ptr) const {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = ranges_.upper_bound(addr);
  if (it == ranges_.begin()) return false;
  --it;
  return addr < it->first + it->second.size;
}

}  // namespace simcuda
