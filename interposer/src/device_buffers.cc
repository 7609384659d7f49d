#include "device_buffers.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "call_protocol.h"
#include "shared_memfd.h"

namespace jitckpt {
namespace {

std::vector<uint8_t> device_copy_request(uint64_t token, uint64_t seq, const std::vector<proxy::DeviceRange>& ranges,
                                         bool unsynchronized) {
  const proxy::RequestHead head{seq, 0u, 0};
  const proxy::DeviceCopy c{token, ranges.size(), unsynchronized ? 1u : 0u};
  std::vector<uint8_t> request(sizeof head + sizeof c + ranges.size() * sizeof(proxy::DeviceRange));
  std::memcpy(request.data(), &head, sizeof head);
  std::memcpy(request.data() + sizeof head, &c, sizeof c);
  if (!ranges.empty()) std::memcpy(request.data() + sizeof head + sizeof c, ranges.data(), ranges.size() * sizeof ranges[0]);
  return request;
}

proxy::CallResult device_copy(proxy::ProxyClient& client, proxy::ProxyChannel& ch, proxy::Call call, int fd,
                              uint64_t token, const std::vector<proxy::DeviceRange>& ranges,
                              std::chrono::milliseconds timeout, bool unsynchronized = false) {
  proxy::CallResult r;
  if (!client.send_fd(fd, token)) {
    r.status = 999;
    r.error = client.death();
    return r;
  }
  const uint64_t seq = ch.next_seq();
  const std::vector<uint8_t> request = device_copy_request(token, seq, ranges, unsynchronized);
  return ch.call_raw(static_cast<uint32_t>(call), request.data(), request.size(), seq, timeout);
}

std::string failure(const proxy::CallResult& r) {
  return r.error.empty() ? "status " + std::to_string(r.status) : r.error;
}

}  // namespace

DeviceBuffers::~DeviceBuffers() { reset(); }

DeviceBuffers::DeviceBuffers(DeviceBuffers&& other) noexcept { *this = std::move(other); }

DeviceBuffers& DeviceBuffers::operator=(DeviceBuffers&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.fd_;
    ranges_ = std::move(other.ranges_);
    total_ = other.total_;
    other.fd_ = -1;
    other.total_ = 0;
  }
  return *this;
}

void DeviceBuffers::reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  ranges_.clear();
  total_ = 0;
}

bool DeviceBuffers::save(proxy::ProxyClient& client, proxy::ProxyChannel& ch, uint64_t token,
                         const std::vector<ReplayJournal::DeviceRange>& allocations, std::chrono::milliseconds timeout,
                         std::string* why, WaitFor wait) {
  reset();
  for (const ReplayJournal::DeviceRange& a : allocations) {
    ranges_.push_back(proxy::DeviceRange{a.base, a.size, total_});
    total_ += (a.size + 4095) / 4096 * 4096;
  }
  fd_ = shared_memfd("jitckpt-device-buffers", total_ > 0 ? total_ : 4096);
  if (fd_ < 0) {
    *why = std::string("cannot make a memfd for the device buffers: ") + std::strerror(errno);
    return false;
  }
  const proxy::CallResult r = device_copy(client, ch, proxy::Call::kSaveDevice, fd_, token, ranges_, timeout,
                                              wait == WaitFor::kNothing);
  if (r.status != 0) {
    *why = "copying the " + std::to_string(ranges_.size()) + " buffers (" + std::to_string(total_ >> 20) +
           " MiB) out of the proxy failed: " + failure(r);
    reset();
    return false;
  }
  return true;
}

bool DeviceBuffers::restore(proxy::ProxyClient& client, proxy::ProxyChannel& ch, uint64_t token,
                            std::string* why) const {
  const proxy::CallResult r =
      device_copy(client, ch, proxy::Call::kRestoreDevice, fd_, token, ranges_, std::chrono::hours(24));
  if (r.status == 0) return true;
  *why = "putting the saved buffers into the new proxy failed: " + failure(r);
  return false;
}

std::string DeviceBuffers::first_difference(const DeviceBuffers& other) const {
  if (ranges_.size() != other.ranges_.size() || total_ != other.total_) return "the two sets of buffers differ in shape";
  if (total_ == 0) return "";
  void* a = mmap(nullptr, total_, PROT_READ, MAP_SHARED, fd_, 0);
  void* b = mmap(nullptr, total_, PROT_READ, MAP_SHARED, other.fd_, 0);
  std::string diff;
  if (a == MAP_FAILED || b == MAP_FAILED) {
    diff = std::string("cannot map the saved buffers: ") + std::strerror(errno);
  } else {
    for (const proxy::DeviceRange& r : ranges_) {
      const auto* x = static_cast<const uint8_t*>(a) + r.offset;
      const auto* y = static_cast<const uint8_t*>(b) + r.offset;
      if (std::memcmp(x, y, r.size) == 0) continue;
      size_t at = 0;
      while (x[at] == y[at]) ++at;
      char text[160];
      std::snprintf(text, sizeof text, "the allocation at 0x%llx (%llu bytes) differs from byte %zu on",
                    static_cast<unsigned long long>(r.base), static_cast<unsigned long long>(r.size), at);
      diff = text;
      break;
    }
  }
  if (a != MAP_FAILED) munmap(a, total_);
  if (b != MAP_FAILED) munmap(b, total_);
  return diff;
}

}  // namespace jitckpt
