// The client's end of a device proxy: starts `jitckpt-proxy`, hands it the rings, makes
// synchronous calls and posts no-reply ones (issue 15). libjit.so's proxy mode is built on it
// (interposer/src/proxy_session.cc).
//
// Lifetime: the proxy exits when this process dies (it watches the handshake socket). A proxy that
// dies is noticed within one wait slice of a call, which then fails with a message naming its
// pid and how it died; no call waits forever.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
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

class ProxyClient;

// One pair of rings to the proxy, used by one thread at a time (the rings are single-producer,
// single-consumer). The proxy serves each channel on its own thread.
class ProxyChannel {
 public:
  ProxyChannel(ProxyClient& owner, ShmRing requests, ShmRing replies)
      : owner_(owner), requests_(std::move(requests)), replies_(std::move(replies)) {}
  ProxyChannel(const ProxyChannel&) = delete;
  ProxyChannel& operator=(const ProxyChannel&) = delete;

  // One synchronous call: `args` after the request head, the reply's results back.
  CallResult call(Call c, const void* args, size_t len, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return call(static_cast<uint32_t>(c), args, len, timeout);
  }
  // The same by tag (a Call, or kGenericBase + a generated FunctionId).
  CallResult call(uint32_t tag, const void* args, size_t len, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // A raw request (`payload` starts with its RequestHead) and its reply.
  CallResult call_raw(uint32_t tag, const void* payload, size_t len, uint64_t seq,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // A kNoReply request: returns once it is in the ring. Empty, or why it could not be sent (the
  // proxy died, the request is too large).
  std::string post(uint32_t tag, const void* payload, size_t len,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60));
  // Whether the proxy has executed every request posted without a reply so far (any thread may ask;
  // a synchronous call's own request does not count: it may wait on the device for long).
  bool posted_served() const { return requests_.consumed() >= posted_end_.load(std::memory_order_acquire); }
  uint64_t next_seq() { return ++seq_; }
  ShmRing& request_ring() { return requests_; }  // for tests of the proxy's validation

 private:
  friend class ProxyClient;
  // Puts a request in the ring (waiting while it is full); empty, or why not.
  std::string send(uint32_t tag, const void* payload, size_t len, std::chrono::milliseconds timeout);
  ProxyClient& owner_;
  ShmRing requests_;
  ShmRing replies_;
  uint64_t seq_ = 0;
  std::atomic<uint64_t> posted_end_{0};  // the request ring's position after the last post()
};

class ProxyClient {
 public:
  // Starts `binary` with this process's environment; throws std::runtime_error naming the problem
  // if it cannot start or does not answer within `timeout`. With JITCKPT_PROXY_BROKER set, the node
  // daemon starts it (proxy_broker.h): the proxy is then the daemon's child, not this process's.
  // `env`: the proxy's environment ("NAME=value" strings); this process's when null.
  static std::unique_ptr<ProxyClient> start(const std::string& binary,
                                            std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                            const std::vector<std::string>* env = nullptr);
  ~ProxyClient();
  ProxyClient(const ProxyClient&) = delete;
  ProxyClient& operator=(const ProxyClient&) = delete;

  pid_t pid() const { return pid_; }
  // The channel set up at the handshake (the first thread's).
  ProxyChannel& primary() { return primary_; }
  // A new channel, for another thread; throws std::runtime_error if the proxy cannot be told.
  std::unique_ptr<ProxyChannel> open_channel();
  // Hands a memfd to the proxy (shared host memory, a module); the request that uses it names the same token.
  bool send_fd(int fd, uint64_t token);
  // Why the proxy is gone ("" while it runs). Any thread.
  std::string death() const;

  // The primary channel's calls (tests).
  CallResult call(Call c, const void* args, size_t len, std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return primary_.call(c, args, len, timeout);
  }
  CallResult call_raw(uint32_t tag, const void* payload, size_t len, uint64_t seq,
                      std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return primary_.call_raw(tag, payload, len, seq, timeout);
  }
  std::string post(uint32_t tag, const void* payload, size_t len,
                   std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
    return primary_.post(tag, payload, len, timeout);
  }
  uint64_t next_seq() { return primary_.next_seq(); }
  ShmRing& request_ring() { return primary_.request_ring(); }

 private:
  ProxyClient(pid_t pid, int sock, ShmRing requests, ShmRing replies);
  // The hello and ready exchange with a started proxy; throws naming the problem.
  static std::unique_ptr<ProxyClient> handshake(const std::string& binary, std::chrono::milliseconds timeout,
                                                std::unique_ptr<ProxyClient> client);

  pid_t pid_;
  int sock_;
  std::mutex sock_mu_;  // one message at a time on the socket
  ProxyChannel primary_;
  mutable std::mutex death_mu_;
  mutable bool reaped_ = false;
  mutable int wait_status_ = 0;
};

}  // namespace jitckpt::proxy
