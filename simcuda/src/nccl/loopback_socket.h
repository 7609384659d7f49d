// Blocking TCP-on-loopback helpers for bootstrap (rendezvous and mesh setup).
#pragma once

#include <cstddef>
#include <cstdint>

namespace simcuda::nccl {

// A listening socket on 127.0.0.1 with a kernel-chosen port. Owns the fd.
class Listener {
 public:
  Listener();
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  uint16_t port() const { return port_; }
  int fd() const { return fd_; }
  // Blocks until a peer connects; returns the connected fd (caller owns it) or -1.
  int accept_one() const;
  // Unblocks a pending accept_one (used by abort).
  void shut();

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

// Connects to 127.0.0.1:port; returns the fd or -1.
int connect_loopback(uint16_t port);
// Full-length blocking transfers; false on EOF or error.
bool send_all(int fd, const void* buf, size_t len);
bool recv_all(int fd, void* buf, size_t len);

}  // namespace simcuda::nccl
