// Device allocations copied whole into a memfd of this process (kSaveDevice) and from it into a
// proxy (kRestoreDevice), issue 16: how the buffers of a minibatch's start (parameters, optimizer
// state) go from a proxy whose communicators failed to the one that replaces it, and what the
// replay validation compares.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "proxy_client.h"
#include "replay_journal.h"

namespace jitckpt {

class DeviceBuffers {
 public:
  DeviceBuffers() = default;
  ~DeviceBuffers();
  DeviceBuffers(DeviceBuffers&& other) noexcept;
  DeviceBuffers& operator=(DeviceBuffers&& other) noexcept;
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;

  // kQueuedWork: the device finishes what it has queued first. kNothing: the copies run at once on
  // a stream of their own (a device blocked behind a hung collective).
  enum class WaitFor { kQueuedWork, kNothing };
  // Copies `allocations` out of the proxy behind `ch` (bounded by `timeout`). False with `why`;
  // `token` names the memfd on the proxy's socket.
  bool save(proxy::ProxyClient& client, proxy::ProxyChannel& ch, uint64_t token,
            const std::vector<ReplayJournal::DeviceRange>& allocations, std::chrono::milliseconds timeout,
            std::string* why, WaitFor wait = WaitFor::kQueuedWork);
  // Puts them into the proxy behind `ch` (the allocations must exist there, at the same addresses).
  bool restore(proxy::ProxyClient& client, proxy::ProxyChannel& ch, uint64_t token, std::string* why) const;
  // The first allocation whose bytes differ from `other`'s (saved from the same allocations), or "".
  std::string first_difference(const DeviceBuffers& other) const;
  // A file other ranks read them from (a data-parallel replica's buffers, issue 16 case 3): written
  // whole under a temporary name, then renamed into place. False with `why`.
  bool write_file(const std::string& path, std::string* why) const;
  // Reads a file write_file made; its allocations must be `expected` (same bases and sizes, in
  // order: a replica runs the same allocations), else false with `why`. Verified to the byte count.
  bool read_file(const std::string& path, const std::vector<ReplayJournal::DeviceRange>& expected, std::string* why);
  bool empty() const { return fd_ < 0; }
  uint64_t bytes() const { return total_; }

 private:
  void reset();

  int fd_ = -1;
  std::vector<proxy::DeviceRange> ranges_;
  uint64_t total_ = 0;
};

}  // namespace jitckpt
