#include "device_buffers.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "call_protocol.h"
#include "shared_memfd.h"
#include "unique_fd.h"

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

constexpr char kFileMagic[8] = {'J', 'I', 'T', 'B', 'U', 'F', '1', '\0'};

// Copies `n` bytes between two descriptors at their offsets (pread/pwrite: no shared file position).
bool copy_bytes(int from, off_t from_at, int to, off_t to_at, uint64_t n) {
  std::vector<char> chunk(std::min<uint64_t>(n, uint64_t{8} << 20));
  for (uint64_t done = 0; done < n;) {
    const ssize_t r = pread(from, chunk.data(), std::min<uint64_t>(chunk.size(), n - done), from_at + static_cast<off_t>(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    for (ssize_t w = 0; w < r;) {
      const ssize_t k = pwrite(to, chunk.data() + w, static_cast<size_t>(r - w), to_at + static_cast<off_t>(done) + w);
      if (k < 0 && errno == EINTR) continue;
      if (k <= 0) return false;
      w += k;
    }
    done += static_cast<uint64_t>(r);
  }
  return true;
}

}  // namespace

bool DeviceBuffers::write_file(const std::string& path, std::string* why) const {
  const std::string tmp = path + ".tmp";
  {
    UniqueFd f(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    std::string head(kFileMagic, sizeof kFileMagic);
    const uint64_t count = ranges_.size();
    head.append(reinterpret_cast<const char*>(&count), sizeof count);
    head.append(reinterpret_cast<const char*>(&total_), sizeof total_);
    if (!ranges_.empty()) head.append(reinterpret_cast<const char*>(ranges_.data()), ranges_.size() * sizeof ranges_[0]);
    const bool ok = f.get() >= 0 && pwrite(f.get(), head.data(), head.size(), 0) == static_cast<ssize_t>(head.size()) &&
                    (total_ == 0 || copy_bytes(fd_, 0, f.get(), static_cast<off_t>(head.size()), total_)) &&
                    fsync(f.get()) == 0;
    if (!ok) {
      *why = "cannot write " + tmp + ": " + std::strerror(errno);
      unlink(tmp.c_str());
      return false;
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    *why = "cannot rename " + tmp + " into place: " + std::strerror(errno);
    unlink(tmp.c_str());
    return false;
  }
  return true;
}

bool DeviceBuffers::read_file(const std::string& path, const std::vector<ReplayJournal::DeviceRange>& expected,
                              std::string* why) {
  reset();
  UniqueFd f(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  char magic[sizeof kFileMagic];
  uint64_t count = 0, total = 0;
  struct stat st {};
  if (f.get() < 0 || pread(f.get(), magic, sizeof magic, 0) != sizeof magic ||
      std::memcmp(magic, kFileMagic, sizeof magic) != 0 ||
      pread(f.get(), &count, sizeof count, sizeof magic) != sizeof count ||
      pread(f.get(), &total, sizeof total, sizeof magic + sizeof count) != sizeof total || fstat(f.get(), &st) != 0) {
    *why = "cannot read the replica's buffers in " + path + (f.get() < 0 ? ": " + std::string(std::strerror(errno)) : " (not a buffers file)");
    return false;
  }
  const off_t data_at = static_cast<off_t>(sizeof magic + 2 * sizeof(uint64_t) + count * sizeof(proxy::DeviceRange));
  if (count != expected.size() || static_cast<uint64_t>(st.st_size) != static_cast<uint64_t>(data_at) + total) {
    *why = "the replica's buffers in " + path + " are " + std::to_string(count) + " allocations (" +
           std::to_string(st.st_size) + " bytes), this rank has " + std::to_string(expected.size()) +
           ": not a data-parallel replica of this rank, or a truncated file";
    return false;
  }
  std::vector<proxy::DeviceRange> ranges(count);
  if (count && pread(f.get(), ranges.data(), count * sizeof ranges[0], sizeof magic + 2 * sizeof(uint64_t)) !=
                   static_cast<ssize_t>(count * sizeof ranges[0])) {
    *why = "cannot read the allocations of " + path;
    return false;
  }
  for (size_t i = 0; i < count; ++i) {
    if (ranges[i].base != expected[i].base || ranges[i].size != expected[i].size || ranges[i].offset > total ||
        ranges[i].size > total - ranges[i].offset) {
      char text[200];
      std::snprintf(text, sizeof text, "allocation %zu of the replica is [0x%llx, +%llu), this rank's [0x%llx, +%llu)", i,
                    static_cast<unsigned long long>(ranges[i].base), static_cast<unsigned long long>(ranges[i].size),
                    static_cast<unsigned long long>(expected[i].base), static_cast<unsigned long long>(expected[i].size));
      *why = std::string(text) + ": not a data-parallel replica of this rank";
      return false;
    }
  }
  fd_ = shared_memfd("jitckpt-device-buffers", total > 0 ? total : 4096);
  if (fd_ < 0 || (total > 0 && !copy_bytes(f.get(), data_at, fd_, 0, total))) {
    *why = "cannot copy the replica's buffers from " + path + ": " + std::strerror(errno);
    reset();
    return false;
  }
  ranges_ = std::move(ranges);
  total_ = total;
  return true;
}

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
