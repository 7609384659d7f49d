// File descriptors that arrived on the proxy's socket, waiting for the request that names them
// (the memfd of shared host memory or of a module, and the kHostAlloc or kRegisterModule naming it). The socket has one reader, the proxy's listener
// thread; the channel thread that needs the fd waits here, bounded.
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>

namespace jitckpt::proxy {

class FdMailbox {
 public:
  ~FdMailbox() {
    for (auto& [token, fd] : fds_) close(fd);
  }
  void put(uint64_t token, int fd) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!fds_.emplace(token, fd).second) close(fd);  // a token used twice: keep the first
    }
    cv_.notify_all();
  }
  // The fd sent with `token`, or -1 if it did not come within `timeout`.
  int take(uint64_t token, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return fds_.count(token) != 0; })) return -1;
    const int fd = fds_[token];
    fds_.erase(token);
    return fd;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, int> fds_;
};

}  // namespace jitckpt::proxy
