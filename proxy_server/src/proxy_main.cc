// jitckpt-proxy: the device proxy process (issue 15). One per device client; started by the
// client (ProxyClient::start) with the Unix socket of its handshake as fd 3.
//
// It receives the request and reply rings over that socket, answers Ready, then executes the
// calls it reads, on the real CUDA runtime it links (simcuda here). It lives as long as its client:
// the socket's other end closes when the client process dies, whatever killed it, and the proxy
// exits within one idle slice (a parent-death signal would fire on the death of the forking
// thread, not of the process). A corrupt request ring is reported on stderr and to the client;
// the proxy then stops reading it and waits for the client to go, rather than crashing.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "call_dispatcher.h"
#include "call_protocol.h"
#include "proxy_functions.h"
#include "shm_ring.h"

using namespace jitckpt::proxy;  // NOLINT: this file is the proxy's main and nothing else
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSocketFd = 3;
constexpr auto kIdleSlice = std::chrono::milliseconds(100);

bool client_gone(int sock) {
  pollfd p{sock, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR)) return true;
  char c;
  return recv(sock, &c, 1, MSG_DONTWAIT | MSG_PEEK) == 0;  // orderly close
}

// Receives Hello and the two ring fds; false with a message on stderr if the client sent junk.
bool receive_rings(int sock, int* req_fd, int* rep_fd) {
  Hello hello{};
  iovec iov{&hello, sizeof hello};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (n != static_cast<ssize_t>(sizeof hello) || hello.magic != kHelloMagic || c == nullptr ||
      c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int))) {
    std::fprintf(stderr, "jitckpt-proxy: the client's hello is malformed (not a jitckpt proxy client?)\n");
    return false;
  }
  int fds[2];
  std::memcpy(fds, CMSG_DATA(c), sizeof fds);
  *req_fd = fds[0];
  *rep_fd = fds[1];
  return true;
}

void send_ready(int sock, int status, const std::string& text) {
  Ready r{};
  r.magic = kHelloMagic;
  r.version = kProtocolVersion;
  r.inventory_hash = kInventoryHash;
  r.pid = getpid();
  r.status = status;
  std::snprintf(r.text, sizeof r.text, "%s", text.c_str());
  (void)!send(sock, &r, sizeof r, MSG_NOSIGNAL);
}

// The proxy's lifetime is its client's even while a call blocks (a synchronize behind a collective
// whose peer died never returns): this thread waits for the socket to close and ends the process.
// It polls for hang-up only, so the memfds the dispatcher reads from the socket are not taken.
void exit_with_client(int sock) {
  std::thread([sock] {
    while (true) {
      pollfd p{sock, POLLRDHUP, 0};
      if (poll(&p, 1, -1) > 0 && (p.revents & (POLLHUP | POLLRDHUP | POLLERR | POLLNVAL)) != 0) _exit(0);
    }
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1) {
    std::fprintf(stderr, "usage: %s (started by libjit.so in proxy mode, with its socket as fd 3)\n", argv[0]);
    return 2;
  }
#if !defined(__SANITIZE_THREAD__)  // ThreadSanitizer keeps that range for its shadow memory
  // Device memory at a fixed address, so that a restarted proxy hands out the same pointers
  // (simcuda reads this; on a GPU the proxy would reserve the range with cuMemAddressReserve,
  // which is not built). An explicit setting wins.
  setenv("SIMCUDA_ARENA_BASE", "0x300000000000", 0);
#endif
  int req_fd = -1, rep_fd = -1;
  if (!receive_rings(kSocketFd, &req_fd, &rep_fd)) return 2;
  std::vector<uint8_t> reply;
  try {
    ShmRing requests = ShmRing::attach(req_fd);
    ShmRing replies = ShmRing::attach(rep_fd);
    close(req_fd);
    close(rep_fd);
    send_ready(kSocketFd, 0, "");
    exit_with_client(kSocketFd);
    CallDispatcher dispatcher(kSocketFd);
    bool ring_ok = true;
    while (true) {
      uint32_t call;
      const uint8_t* data;
      size_t len;
      std::string error;
      RingStatus s = ring_ok ? requests.peek(&call, &data, &len, Clock::now() + kIdleSlice, &error)
                             : RingStatus::kTimeout;
      if (s == RingStatus::kTimeout) {
        if (client_gone(kSocketFd)) return 0;
        if (!ring_ok) poll(nullptr, 0, static_cast<int>(kIdleSlice.count()));
        continue;
      }
      if (s == RingStatus::kCorrupt) {
        std::fprintf(stderr, "jitckpt-proxy: corrupt request ring: %s; no further calls are read\n", error.c_str());
        ReplyHead head{};
        head.status = 999;  // cudaErrorUnknown
        head.has_text = 1;
        std::snprintf(head.text, sizeof head.text, "corrupt request ring: %s", error.c_str());
        replies.push(0, &head, sizeof head, Clock::now() + std::chrono::seconds(1));
        ring_ok = false;
        continue;
      }
      const bool answer = dispatcher.handle(call, data, len, &reply);
      requests.release();
      if (!answer) continue;
      if (reply.size() > replies.max_payload()) {  // a client that asked for more than a reply holds
        ReplyHead head{};
        std::memcpy(&head, reply.data(), sizeof head);
        head.status = 1;  // cudaErrorInvalidValue
        head.has_text = 1;
        std::snprintf(head.text, sizeof head.text, "%s: a reply of %zu bytes exceeds the ring's %zu",
                      call_name(call), reply.size(), replies.max_payload());
        reply.assign(reinterpret_cast<const uint8_t*>(&head), reinterpret_cast<const uint8_t*>(&head) + sizeof head);
      }
      if (replies.push(call, reply.data(), reply.size(), Clock::now() + std::chrono::seconds(10)) !=
          RingStatus::kOk) {
        std::fprintf(stderr, "jitckpt-proxy: the client read no reply for 10 s; exiting\n");
        return 3;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "jitckpt-proxy: %s\n", e.what());
    send_ready(kSocketFd, 1, e.what());
    return 2;
  }
}
