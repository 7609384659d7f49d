// jitckpt-proxy: the device proxy process (issue 15). One per device client; started by the
// client (ProxyClient::start) with the Unix socket of its handshake as fd 3.
//
// It receives the first channel's request and reply rings over that socket, answers Ready, then
// executes the calls it reads on the real CUDA runtime it links (simcuda here), one thread per
// channel (the client opens one per thread that makes calls). It lives as long as its client: the
// socket's other end closes when the client process dies, whatever killed it, and the proxy exits
// at once, even if a channel is blocked in a call (a parent-death signal would fire on the death
// of the forking thread, not of the process). A corrupt request ring is reported on stderr and to
// the client; the proxy stops reading that ring rather than crashing.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "call_dispatcher.h"
#include "call_protocol.h"
#include "proxy_functions.h"
#include "shm_ring.h"

using namespace jitckpt::proxy;  // NOLINT: this file is the proxy's main and nothing else
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSocketFd = 3;
// An idle channel thread sleeps on its ring's futex; the listener, not this wait, ends the process.
constexpr auto kIdleSlice = std::chrono::hours(1);

// One message from the socket with up to two file descriptors (SCM_RIGHTS): its length (0: the
// client closed the socket; < 0: an error) and the fds, in `fds`/`nfds`.
ssize_t receive_with_fds(int sock, void* data, size_t len, int fds[2], size_t* nfds) {
  iovec iov{data, len};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  *nfds = 0;
  for (cmsghdr* c = n > 0 ? CMSG_FIRSTHDR(&msg) : nullptr; c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      *nfds = std::min<size_t>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int), 2);
      std::memcpy(fds, CMSG_DATA(c), *nfds * sizeof(int));
    }
  }
  return n;
}

// Receives Hello and the two ring fds; false with a message on stderr if the client sent junk.
bool receive_rings(int sock, int* req_fd, int* rep_fd) {
  Hello hello{};
  int fds[2] = {-1, -1};
  size_t nfds = 0;
  const ssize_t n = receive_with_fds(sock, &hello, sizeof hello, fds, &nfds);
  if (n != static_cast<ssize_t>(sizeof hello) || hello.magic != kHelloMagic || nfds != 2) {
    std::fprintf(stderr, "jitckpt-proxy: the client's hello is malformed (not a jitckpt proxy client?)\n");
    return false;
  }
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

// Serves one channel (a client thread's rings) until the client closes it (its thread exited), its
// ring is corrupt or the client stops reading replies; the process ends when the client goes
// (listen below).
void serve_channel(ShmRing requests, ShmRing replies, DeviceState& state) {
  CallDispatcher dispatcher(state);
  std::vector<uint8_t> reply;
  while (true) {
    uint32_t call;
    const uint8_t* data;
    size_t len;
    std::string error;
    RingStatus s = requests.peek(&call, &data, &len, Clock::now() + kIdleSlice, &error);
    if (s == RingStatus::kTimeout) continue;
    if (s == RingStatus::kCorrupt) {
      std::fprintf(stderr, "jitckpt-proxy: corrupt request ring: %s; no further calls are read from it\n",
                   error.c_str());
      ReplyHead head{};
      head.status = 999;  // cudaErrorUnknown
      head.has_text = 1;
      std::snprintf(head.text, sizeof head.text, "corrupt request ring: %s", error.c_str());
      replies.push(0, &head, sizeof head, Clock::now() + std::chrono::seconds(1));
      return;
    }
    if (call == static_cast<uint32_t>(Call::kCloseChannel)) return;  // everything before it was served
    const bool answer = dispatcher.handle(call, data, len, &reply);
    requests.release();
    if (!answer) continue;
    if (reply.size() > replies.max_payload()) {  // a client that asked for more than a reply holds
      ReplyHead head{};
      std::memcpy(&head, reply.data(), sizeof head);
      head.status = 1;  // cudaErrorInvalidValue
      head.has_text = 1;
      std::snprintf(head.text, sizeof head.text, "%s: a reply of %zu bytes exceeds the ring's %zu", call_name(call),
                    reply.size(), replies.max_payload());
      reply.assign(reinterpret_cast<const uint8_t*>(&head), reinterpret_cast<const uint8_t*>(&head) + sizeof head);
    }
    if (replies.push(call, reply.data(), reply.size(), Clock::now() + std::chrono::seconds(10)) != RingStatus::kOk) {
      std::fprintf(stderr, "jitckpt-proxy: the client read no reply for 10 s; this channel stops\n");
      return;
    }
  }
}

// The socket's one reader: memfds of shared host memory and modules (into the mailbox) and new channels (a thread
// each). Returns when the client is gone, whatever killed it, even while a channel thread is
// blocked in a call that never returns (a collective whose peer died).
void listen(int sock, DeviceState& state) {
  while (true) {
    SocketMessage m{};
    int fds[2] = {-1, -1};
    size_t nfds = 0;
    const ssize_t n = receive_with_fds(sock, &m, sizeof m, fds, &nfds);
    if (n == 0 || (n < 0 && errno != EINTR)) return;
    if (n == static_cast<ssize_t>(sizeof m) && m.kind == SocketMessage::kMemfd && nfds == 1) {
      state.mailbox.put(m.token, fds[0]);
    } else if (n == static_cast<ssize_t>(sizeof m) && m.kind == SocketMessage::kOpenChannel && nfds == 2) {
      try {
        ShmRing requests = ShmRing::attach(fds[0]);
        ShmRing replies = ShmRing::attach(fds[1]);
        std::thread(serve_channel, std::move(requests), std::move(replies), std::ref(state)).detach();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "jitckpt-proxy: a new channel's rings are unusable: %s\n", e.what());
      }
      close(fds[0]);
      close(fds[1]);
    } else {
      std::fprintf(stderr, "jitckpt-proxy: a malformed message on the socket (%zd bytes, %zu fds) was dropped\n", n,
                   nfds);
      for (size_t i = 0; i < nfds; ++i) close(fds[i]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 1) {
    std::fprintf(stderr, "usage: %s (started by libjit.so in proxy mode, with its socket as fd 3)\n", argv[0]);
    return 2;
  }
  // Device memory is the proxy's fixed arena (FixedArena, through the driver's VMM calls), on
  // simcuda as on a GPU: simcuda's own fixed-address knob must not take that range first.
  unsetenv("SIMCUDA_ARENA_BASE");
  int req_fd = -1, rep_fd = -1;
  if (!receive_rings(kSocketFd, &req_fd, &rep_fd)) return 2;
  try {
    ShmRing requests = ShmRing::attach(req_fd);
    ShmRing replies = ShmRing::attach(rep_fd);
    close(req_fd);
    close(rep_fd);
    send_ready(kSocketFd, 0, "");
    static DeviceState state;  // outlives the channel threads, which the exit ends
    std::thread(serve_channel, std::move(requests), std::move(replies), std::ref(state)).detach();
    listen(kSocketFd, state);  // returns when the client is gone
    std::fflush(stderr);
    _exit(0);  // the channel threads may be inside a blocking call: do not wait for them
  } catch (const std::exception& e) {
    std::fprintf(stderr, "jitckpt-proxy: %s\n", e.what());
    send_ready(kSocketFd, 1, e.what());
    return 2;
  }
}
