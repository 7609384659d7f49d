#include "rendezvous_store.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "unique_fd.h"

namespace jitckpt {
namespace {

void put_u32(std::string* s, uint32_t v) { s->append(reinterpret_cast<const char*>(&v), sizeof v); }

// Reads or writes all of [p, p + n) before `deadline`.
bool transfer(int fd, char* p, size_t n, bool write, std::chrono::steady_clock::time_point deadline) {
  while (n > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int ready = poll(&pfd, 1, static_cast<int>(std::min<int64_t>(left.count(), 1000)));
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    const ssize_t done = write ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (done < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (done <= 0) return false;
    p += done;
    n -= static_cast<size_t>(done);
  }
  return true;
}

}  // namespace

RendezvousStore::RendezvousStore() {
  if (const char* p = std::getenv("JITCKPT_STORE_SOCKET"); p != nullptr) path_ = p;
}

bool RendezvousStore::request(const std::string& message, std::chrono::milliseconds timeout, std::string* reply,
                              std::string* why) const {
  // The launcher answers a get when the key is there or the wait is over: a little longer here.
  const auto deadline = std::chrono::steady_clock::now() + timeout + std::chrono::seconds(10);
  UniqueFd s(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (s.get() < 0 || path_.size() >= sizeof addr.sun_path) {
    *why = "cannot open a socket to the launcher's store at " + path_;
    return false;
  }
  std::memcpy(addr.sun_path, path_.c_str(), path_.size() + 1);
  if (connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    *why = "cannot reach the launcher's store at " + path_ + ": " + std::strerror(errno);
    return false;
  }
  std::string out = message;
  uint8_t status = 0;
  uint32_t size = 0;
  if (!transfer(s.get(), out.data(), out.size(), true, deadline) ||
      !transfer(s.get(), reinterpret_cast<char*>(&status), 1, false, deadline) ||
      !transfer(s.get(), reinterpret_cast<char*>(&size), sizeof size, false, deadline) || size > (1u << 20)) {
    *why = "the launcher's store at " + path_ + " did not answer";
    return false;
  }
  std::string body(size, '\0');
  if (!transfer(s.get(), body.data(), size, false, deadline)) {
    *why = "the launcher's store at " + path_ + " did not answer";
    return false;
  }
  if (status != 0) {
    *why = status == 1 ? "not in the launcher's store within " + std::to_string(timeout.count() / 1000) + " s"
                       : "the launcher's store failed: " + body;
    return false;
  }
  *reply = std::move(body);
  return true;
}

bool RendezvousStore::set(const std::string& key, const std::string& value, std::string* why) const {
  std::string m = "S";
  put_u32(&m, static_cast<uint32_t>(key.size()));
  m += key;
  put_u32(&m, static_cast<uint32_t>(value.size()));
  m += value;
  std::string ignored;
  return request(m, std::chrono::seconds(30), &ignored, why);
}

bool RendezvousStore::get(const std::string& key, std::chrono::milliseconds timeout, std::string* value,
                          std::string* why) const {
  std::string m = "G";
  put_u32(&m, static_cast<uint32_t>(key.size()));
  m += key;
  put_u32(&m, static_cast<uint32_t>(timeout.count()));
  if (request(m, timeout, value, why)) return true;
  *why = "key " + key + ": " + *why;
  return false;
}

}  // namespace jitckpt
