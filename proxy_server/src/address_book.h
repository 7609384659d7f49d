// The memory a request may name: device allocations this proxy made and pinned host memory the
// client shares with it. Every address from the client is checked here before the CUDA runtime sees
// it, so a stale or hostile pointer is an error with a message, not a wild access. Shared by the
// proxy's channel threads: every method locks.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>

namespace jitckpt::proxy {

class AddressBook {
 public:
  enum class Kind { kNone, kDevice, kPinned };

  void add(uint64_t base, uint64_t size, Kind kind) {
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[base] = Range{size, kind};
  }
  bool remove(uint64_t base, Kind kind) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(base);
    if (it == ranges_.end() || it->second.kind != kind) return false;
    ranges_.erase(it);
    return true;
  }
  // The kind of memory [ptr, ptr + count) lies in entirely; kNone if it is not all inside one range.
  Kind kind_of(uint64_t ptr, uint64_t count) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(ptr);
    if (it == ranges_.begin()) return Kind::kNone;
    --it;
    const uint64_t size = it->second.size;
    if (ptr - it->first >= size || count > size - (ptr - it->first)) return Kind::kNone;
    return it->second.kind;
  }
  uint64_t size_of(uint64_t base) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.find(base);
    return it == ranges_.end() ? 0 : it->second.size;
  }

 private:
  struct Range {
    uint64_t size;
    Kind kind;
  };
  mutable std::mutex mu_;
  std::map<uint64_t, Range> ranges_;
};

}  // namespace jitckpt::proxy
