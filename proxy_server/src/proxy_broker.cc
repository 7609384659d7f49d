#include "proxy_broker.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace jitckpt::proxy {
namespace {

constexpr char kMagic[] = "jitckpt-proxy-spawn/1";
constexpr size_t kMaxRequest = size_t{1} << 20;  // the daemon refuses larger ones unread

std::runtime_error broker_error(const std::string& path, const std::string& what) {
  return std::runtime_error("the node daemon's proxy broker (" + path + "): " + what);
}

// Closes a descriptor on every way out unless released.
class OwnedFd {
 public:
  explicit OwnedFd(int fd = -1) : fd_(fd) {}
  ~OwnedFd() { reset(-1); }
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  void reset(int fd) {
    if (fd_ >= 0) close(fd_);
    fd_ = fd;
  }
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_;
};

}  // namespace

std::string ProxyBroker::from_environment() {
  const char* v = std::getenv("JITCKPT_PROXY_BROKER");
  return v != nullptr ? v : "";
}

ProxyBroker::Spawned ProxyBroker::spawn(const std::string& binary, const std::vector<std::string>& env,
                                        std::chrono::milliseconds timeout) const {
  std::string request(kMagic, sizeof kMagic);  // with its NUL
  request += binary;
  request.push_back('\0');
  for (const std::string& e : env) {
    request += e;
    request.push_back('\0');
  }
  if (request.size() > kMaxRequest)
    throw broker_error(socket_path_, "the proxy's environment is over " + std::to_string(kMaxRequest) + " bytes");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof addr.sun_path) throw broker_error(socket_path_, "socket path too long");
  std::memcpy(addr.sun_path, socket_path_.c_str(), socket_path_.size() + 1);
  OwnedFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (sock.get() < 0) throw broker_error(socket_path_, std::string("socket: ") + std::strerror(errno));
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw broker_error(socket_path_, std::string("connect: ") + std::strerror(errno) + " (is `jitckpt daemon run` running?)");
  if (send(sock.get(), request.data(), request.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(request.size()))
    throw broker_error(socket_path_, std::string("send: ") + std::strerror(errno));
  pollfd p{sock.get(), POLLIN, 0};
  if (poll(&p, 1, static_cast<int>(timeout.count())) <= 0)
    throw broker_error(socket_path_, "no answer within " + std::to_string(timeout.count()) + " ms");
  char reply[4096] = {};
  iovec iov{reply, sizeof reply - 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  const ssize_t n = recvmsg(sock.get(), &msg, MSG_CMSG_CLOEXEC);
  if (n <= 0) throw broker_error(socket_path_, "closed the connection without an answer");
  OwnedFd proxy_end;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c))
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int))) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
      proxy_end.reset(fd);
    }
  const std::string text(reply, static_cast<size_t>(n));
  if (text.rfind("ok ", 0) != 0) throw broker_error(socket_path_, text.rfind("error ", 0) == 0 ? text.substr(6) : text);
  char* end = nullptr;
  const long pid = std::strtol(text.c_str() + 3, &end, 10);
  if (pid <= 0 || proxy_end.get() < 0) throw broker_error(socket_path_, "a malformed answer: " + text);
  return Spawned{static_cast<pid_t>(pid), proxy_end.release()};
}

}  // namespace jitckpt::proxy
