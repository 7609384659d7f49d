// Virtual handles (issue 15): the application holds these values for its streams, events,
// communicators, ...; the proxy maps them to the physical objects it created, so a restarted proxy
// can recreate the objects under the same values (issue 16). The values are not addresses of
// anything in the application, and an unknown one is an error, never a wild dereference. Shared by
// the proxy's channel threads: every method locks.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace jitckpt::proxy {

class HandleTable {
 public:
  // The virtual handle for a physical object a call just created (0 when it failed or is null).
  template <typename T>
  uint64_t mint(T physical, bool created) {
    if (!created || physical == nullptr) return 0;
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t v = kBase + 16 * (++minted_);
    objects_[v] = reinterpret_cast<void*>(physical);
    return v;
  }
  // The physical object of `virt`; false if this proxy never handed `virt` out. The null handle and
  // the stream constants (cudaStreamLegacy, cudaStreamPerThread) are their own physical values.
  template <typename T>
  bool resolve(uint64_t virt, T* physical) const {
    if (virt <= 2) {
      *physical = reinterpret_cast<T>(virt);
      return true;
    }
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(virt);
    if (it == objects_.end()) return false;
    *physical = reinterpret_cast<T>(it->second);
    return true;
  }
  void forget(uint64_t virt) {
    std::lock_guard<std::mutex> lock(mu_);
    objects_.erase(virt);
  }

 private:
  // Far from where Linux maps anything on x86-64 and aarch64, so a handle is not mistaken for a
  // pointer by someone reading a core dump.
  static constexpr uint64_t kBase = 0x0000'7a00'0000'0000ull;
  mutable std::mutex mu_;
  uint64_t minted_ = 0;
  std::unordered_map<uint64_t, void*> objects_;
};

}  // namespace jitckpt::proxy
