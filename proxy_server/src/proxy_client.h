// The client's end of a device proxy: starts `jitckpt-proxy`, hands it the rings, makes
// synchronous calls and posts no-reply ones (issue 15). libjit.so's proxy mode is built on it
// (interposer/src/proxy_session.cc).
//
// Lifetime: the proxy exits when this process dies (it watches the handshake socket). A proxy that
// dies is noticed within one wait slice of a call, which then fails with a message naming its
// pid and how it died; no call waits forever.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "call_protocol.h"
#include "shm_ring.h"

namespace jitckpt::proxy {

struct CallResult {
  int32_t status = 0;  // the cudaError_t of the call (999 = cudaErrorUnknown on a transport failure)
  std::string error;   // why, when the proxy or the transport failed; empty otherwise
  std::vector<uint8_t> results;  // what follows the reply head
  // A kNoReply call that failed since the last reply (ReplyHead::async_*); 0 if none.
  int32_t async_status = 0;
  uint32_t async_call = 0;
  uint64_t async_seq = 0;
};

class ProxyClient {
 public:
  // Starts `binary` with this process's environment; throws std::runtime_error naming the problem
  // if it cannot start or does not answer within `timeout`.
  // `env`: the proxy's environment ("NAME=value" strings); this process's when null.
  static std::unique_ptr<ProxyClient> start(const std::string& binary,
                                            std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                            const std::vector<std::string>* env = nullptr);
  ~ProxyClient();
  ProxyClient(const ProxyClient&) = delete;
  ProxyClient& operator=(const ProxyClient&) = delete;

  pid_t pid() const { return pid_; }
  // One synchronous call: `args` after the request head, the reply's results back.
  CallResult call(Call call, const void* args, size_t len, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // For tests of the proxy's validation: the raw request ring and a raw request.
  ShmRing& request_ring() { return requests_; }
  CallResult call_raw(uint32_t tag, const void* payload, size_t len, uint64_t seq,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));
  uint64_t next_seq() { return ++seq_; }
  // A kNoReply request (`payload` starts with its RequestHead): returns once it is in the ring.
  // Empty, or why it could not be sent (the proxy died, the request is too large).
  std::string post(uint32_t tag, const void* payload, size_t len,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Hands `fd` to the proxy over the socket (pinned memory); the next request tells it what it is.
  bool send_fd(int fd);
  // Why the proxy is gone ("" while it runs).
  std::string death() const { return proxy_death(); }

 private:
  ProxyClient(pid_t pid, int sock, ShmRing requests, ShmRing replies);
  std::string proxy_death() const;

  pid_t pid_;
  int sock_;
  ShmRing requests_;
  ShmRing replies_;
  uint64_t seq_ = 0;
  mutable bool reaped_ = false;
  mutable int wait_status_ = 0;
};

}  // namespace jitckpt::proxy
