#include "rendezvous.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "loopback_socket.h"

namespace simcuda::nccl {

ncclUniqueId RendezvousId::encode() const {
  ncclUniqueId out{};
  static_assert(sizeof(RendezvousId) <= sizeof(out.internal), "RendezvousId must fit in ncclUniqueId");
  std::memcpy(out.internal, this, sizeof(*this));
  return out;
}

std::optional<RendezvousId> RendezvousId::decode(const ncclUniqueId& id) {
  RendezvousId r;
  std::memcpy(&r, id.internal, sizeof(r));
  if (r.magic != kMagic || r.root_port == 0) return std::nullopt;
  return r;
}

namespace {
// Serves one communicator: collects every rank's hello, then answers each with the port table.
void serve(std::shared_ptr<Listener> listener, uint64_t nonce) {
  std::vector<int> fds;
  std::vector<uint16_t> ports;
  int nranks = -1, seen = 0;
  std::vector<int> by_rank;
  while (nranks < 0 || seen < nranks) {
    int fd = listener->accept_one();
    if (fd < 0) return;
    RankHello h{};
    if (!recv_all(fd, &h, sizeof(h)) || h.nonce != nonce || h.nranks <= 0 || h.rank < 0 || h.rank >= h.nranks ||
        (nranks >= 0 && h.nranks != nranks)) {
      close(fd);  // a stray or inconsistent rank; it will see its connection closed
      continue;
    }
    if (nranks < 0) {
      nranks = h.nranks;
      ports.assign(static_cast<size_t>(nranks), 0);
      by_rank.assign(static_cast<size_t>(nranks), -1);
    }
    if (by_rank[static_cast<size_t>(h.rank)] >= 0) {
      close(fd);  // duplicate rank
      continue;
    }
    by_rank[static_cast<size_t>(h.rank)] = fd;
    ports[static_cast<size_t>(h.rank)] = h.mesh_port;
    ++seen;
  }
  for (int fd : by_rank) {
    send_all(fd, ports.data(), ports.size() * sizeof(uint16_t));
    close(fd);
  }
}
}  // namespace

RendezvousId start_bootstrap_root() {
  auto listener = std::make_shared<Listener>();
  RendezvousId id;
  std::random_device rd;
  id.nonce = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(getpid());
  id.root_port = listener->port();
  std::thread(serve, listener, id.nonce).detach();
  return id;
}

bool BootstrapSocket::adopt(int fd) {
  std::lock_guard<std::mutex> lock(mu_);
  if (interrupted_) {
    close(fd);
    return false;
  }
  fd_ = fd;
  return true;
}

void BootstrapSocket::release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void BootstrapSocket::interrupt() {
  std::lock_guard<std::mutex> lock(mu_);
  interrupted_ = true;
  if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);
}

std::optional<std::vector<uint16_t>> exchange_ports(const RendezvousId& id, int nranks, int rank,
                                                    uint16_t my_port, BootstrapSocket& socket) {
  int fd = connect_loopback(id.root_port);
  if (fd < 0 || !socket.adopt(fd)) return std::nullopt;
  RankHello h{id.nonce, nranks, rank, my_port};
  std::vector<uint16_t> ports(static_cast<size_t>(nranks));
  // Blocks until every rank has registered with the root (no timeout, like NCCL's bootstrap).
  const bool ok = send_all(fd, &h, sizeof(h)) && recv_all(fd, ports.data(), ports.size() * sizeof(uint16_t));
  socket.release();
  if (!ok) return std::nullopt;
  return ports;
}

}  // namespace simcuda::nccl
