#include "proxy_client.h"

#include "proxy_broker.h"
#include "proxy_functions.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>
#include <thread>
#include <utility>

extern char** environ;

namespace jitckpt::proxy {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int32_t kTransportFailure = 999;  // cudaErrorUnknown
constexpr size_t kRingBytes = size_t{1} << 22;
constexpr auto kWaitSlice = std::chrono::milliseconds(20);

std::runtime_error start_error(const std::string& what) {
  return std::runtime_error("cannot start the jitckpt device proxy: " + what);
}

// One message on the Unix socket with file descriptors attached (SCM_RIGHTS).
bool send_with_fds(int sock, const void* data, size_t len, const int* fds, size_t nfds) {
  iovec iov{const_cast<void*>(data), len};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))] = {};
  if (nfds == 0 || nfds > 2) return false;
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = CMSG_SPACE(nfds * sizeof(int));
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
  std::memcpy(CMSG_DATA(c), fds, nfds * sizeof(int));
  return sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(len);
}

bool socket_closed(int sock) {
  pollfd p{sock, POLLIN, 0};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0;
}

}  // namespace

std::unique_ptr<ProxyClient> ProxyClient::start(const std::string& binary, std::chrono::milliseconds timeout,
                                                const std::vector<std::string>* env) {
  if (const std::string broker = ProxyBroker::from_environment(); !broker.empty()) {
    std::vector<std::string> own;  // the proxy's environment: this process's when none is given
    if (env == nullptr)
      for (char** e = environ; e && *e; ++e) own.emplace_back(*e);
    const ProxyBroker::Spawned s = ProxyBroker(broker).spawn(binary, env ? *env : own, timeout);
    return handshake(binary, timeout, std::unique_ptr<ProxyClient>(new ProxyClient(
        s.pid, s.socket, ShmRing::create(kRingBytes), ShmRing::create(kRingBytes))));
  }
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    throw start_error(std::string("socketpair: ") + std::strerror(errno));
  // Above the fd the child gets (3), so dup2 onto 3 always happens and clears close-on-exec.
  int child = fcntl(sv[1], F_DUPFD_CLOEXEC, 10);
  close(sv[1]);
  ShmRing requests = ShmRing::create(kRingBytes);
  ShmRing replies = ShmRing::create(kRingBytes);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, child, 3);
  char* argv[] = {const_cast<char*>(binary.c_str()), nullptr};
  std::vector<char*> envp;
  if (env != nullptr) {
    for (const std::string& e : *env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
  }
  pid_t pid = -1;
  int rc = posix_spawn(&pid, binary.c_str(), &fa, nullptr, argv, env ? envp.data() : environ);
  posix_spawn_file_actions_destroy(&fa);
  close(child);
  if (rc != 0) {
    close(sv[0]);
    throw start_error(binary + ": " + std::strerror(rc));
  }
  return handshake(binary, timeout,
                   std::unique_ptr<ProxyClient>(new ProxyClient(pid, sv[0], std::move(requests), std::move(replies))));
}

std::unique_ptr<ProxyClient> ProxyClient::handshake(const std::string& binary, std::chrono::milliseconds timeout,
                                                    std::unique_ptr<ProxyClient> client) {
  const Hello hello{kHelloMagic, kProtocolVersion};
  const int fds[2] = {client->primary_.requests_.fd(), client->primary_.replies_.fd()};
  if (!send_with_fds(client->sock_, &hello, sizeof hello, fds, 2))
    throw start_error("handshake: " + client->death());
  pollfd p{client->sock_, POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout.count())) <= 0)
    throw start_error("no answer within " + std::to_string(timeout.count()) + " ms");
  Ready ready{};
  if (recv(client->sock_, &ready, sizeof ready, 0) != static_cast<ssize_t>(sizeof ready) ||
      ready.magic != kHelloMagic)
    throw start_error(binary + " did not answer the handshake: " + client->death());
  if (ready.version != kProtocolVersion)
    throw start_error(binary + " speaks protocol " + std::to_string(ready.version) + ", this client " +
                      std::to_string(kProtocolVersion) + ": install matching versions");
  if (ready.status != 0) throw start_error(std::string(ready.text));
  if (ready.inventory_hash != kInventoryHash)
    throw start_error(binary + " was generated from another CUDA API inventory than this client: install "
                      "libjit.so and jitckpt-proxy from the same build");
  return client;
}

ProxyClient::ProxyClient(pid_t pid, int sock, ShmRing requests, ShmRing replies)
    : pid_(pid), sock_(sock), primary_(*this, std::move(requests), std::move(replies)) {}

std::unique_ptr<ProxyChannel> ProxyClient::open_channel() {
  auto channel = std::make_unique<ProxyChannel>(*this, ShmRing::create(kRingBytes), ShmRing::create(kRingBytes));
  const SocketMessage m{SocketMessage::kOpenChannel, 0, 0};
  const int fds[2] = {channel->requests_.fd(), channel->replies_.fd()};
  std::lock_guard<std::mutex> lock(sock_mu_);
  if (!send_with_fds(sock_, &m, sizeof m, fds, 2))
    throw std::runtime_error("cannot open a channel to the jitckpt device proxy: " + death());
  return channel;
}

ProxyClient::~ProxyClient() {
  close(sock_);  // the proxy sees the socket close and exits
  if (reaped_) return;
  for (int i = 0; i < 100; ++i) {  // bounded: 2 s, then SIGKILL
    if (waitpid(pid_, &wait_status_, WNOHANG) != 0) return;
    std::this_thread::sleep_for(kWaitSlice);
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, &wait_status_, 0);
}

std::string ProxyClient::death() const {
  std::lock_guard<std::mutex> lock(death_mu_);
  if (!reaped_) {
    if (waitpid(pid_, &wait_status_, WNOHANG) == pid_)
      reaped_ = true;
    else if (!socket_closed(sock_))
      return "";  // running (or reaped by the application, but still connected)
    // Its socket closed as it exits: give the kernel a moment to make it reapable, so the cause
    // (a signal, an exit code) can be said. Bounded; reaped elsewhere, it never becomes so.
    for (int i = 0; i < 50 && !reaped_; ++i) {
      std::this_thread::sleep_for(kWaitSlice);
      const pid_t got = waitpid(pid_, &wait_status_, WNOHANG);
      reaped_ = got == pid_;
      if (got < 0) break;  // not our child to reap (the application reaped it)
    }
  }
  std::string who = "jitckpt-proxy (pid " + std::to_string(pid_) + ")";
  if (!reaped_) return who + " closed its connection";  // reaped elsewhere, or exiting
  if (WIFSIGNALED(wait_status_))
    return who + " was killed by signal " + std::to_string(WTERMSIG(wait_status_)) + " (" +
           strsignal(WTERMSIG(wait_status_)) + ")";
  return who + " exited with code " + std::to_string(WEXITSTATUS(wait_status_));
}

CallResult ProxyChannel::call(uint32_t tag, const void* args, size_t len, std::chrono::milliseconds timeout) {
  std::vector<uint8_t> payload(sizeof(RequestHead) + len);
  const uint64_t seq = next_seq();
  const RequestHead head{seq, 0, 0};
  std::memcpy(payload.data(), &head, sizeof head);
  if (len > 0) std::memcpy(payload.data() + sizeof head, args, len);
  return call_raw(tag, payload.data(), payload.size(), seq, timeout);
}

std::string ProxyChannel::post(uint32_t tag, const void* payload, size_t len, std::chrono::milliseconds timeout) {
  std::string why = send(tag, payload, len, timeout);
  if (why.empty()) posted_end_.store(requests_.published(), std::memory_order_release);
  return why;
}

std::string ProxyChannel::send(uint32_t tag, const void* payload, size_t len, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {  // the ring may be full while the proxy works through earlier calls
    RingStatus s = requests_.push(tag, payload, len, std::min(deadline, Clock::now() + kWaitSlice));
    if (s == RingStatus::kOk) return "";
    if (s == RingStatus::kTooLarge)
      return "a request of " + std::to_string(len) + " bytes exceeds the ring's " + std::to_string(requests_.max_payload());
    if (std::string d = owner_.death(); !d.empty()) return d;
    if (Clock::now() >= deadline) return "the request ring stayed full for " + std::to_string(timeout.count()) + " ms";
  }
}

bool ProxyClient::send_fd(int fd, uint64_t token) {
  const SocketMessage m{SocketMessage::kMemfd, 0, token};
  std::lock_guard<std::mutex> lock(sock_mu_);
  return send_with_fds(sock_, &m, sizeof m, &fd, 1);
}

CallResult ProxyChannel::call_raw(uint32_t tag, const void* payload, size_t len, uint64_t seq,
                                 std::chrono::milliseconds timeout) {
  CallResult out;
  auto fail = [&](const std::string& why) {
    out.status = kTransportFailure;
    out.error = why;
    return out;
  };
  const auto deadline = Clock::now() + timeout;
  if (std::string why = send(tag, payload, len, timeout); !why.empty()) return fail(why);
  while (true) {
    uint32_t rtag;
    const uint8_t* data;
    size_t rlen;
    std::string error;
    RingStatus s = replies_.peek(&rtag, &data, &rlen, std::min(deadline, Clock::now() + kWaitSlice), &error);
    if (s == RingStatus::kCorrupt) return fail("corrupt reply ring: " + error);
    if (s == RingStatus::kTimeout) {
      if (std::string d = owner_.death(); !d.empty()) return fail(d);
      if (Clock::now() >= deadline) return fail("no reply within " + std::to_string(timeout.count()) + " ms");
      continue;
    }
    ReplyHead head{};
    if (rlen < sizeof head) {
      replies_.release();
      return fail("a reply of " + std::to_string(rlen) + " bytes is shorter than its head");
    }
    std::memcpy(&head, data, sizeof head);
    head.text[sizeof head.text - 1] = '\0';
    if (rtag != 0 && head.seq != seq) {  // a reply to a call given up on earlier
      replies_.release();
      continue;
    }
    out.status = head.status;
    if (head.has_text) out.error = head.text;
    out.async_status = head.async_status;
    out.async_call = head.async_call;
    out.async_seq = head.async_seq;
    out.results.assign(data + sizeof head, data + rlen);
    replies_.release();
    return out;
  }
}

}  // namespace jitckpt::proxy
