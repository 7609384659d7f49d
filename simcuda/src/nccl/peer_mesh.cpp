#include "peer_mesh.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <stdexcept>

namespace simcuda::nccl {

PeerMesh::PeerMesh(int rank, int nranks) : rank_(rank), nranks_(nranks), fds_(static_cast<size_t>(nranks), -1) {
  if (pipe2(abort_pipe_, O_CLOEXEC | O_NONBLOCK) != 0) throw std::runtime_error("simcuda nccl: pipe2 failed");
}

PeerMesh::~PeerMesh() {
  for (int fd : fds_)
    if (fd >= 0) close(fd);
  close(abort_pipe_[0]);
  close(abort_pipe_[1]);
}

bool PeerMesh::connect(const std::vector<uint16_t>& ports, uint64_t nonce) {
  struct Hello {
    uint64_t nonce;
    int32_t rank;
  };
  for (int peer = 0; peer < rank_; ++peer) {
    int fd = connect_loopback(ports[static_cast<size_t>(peer)]);
    Hello h{nonce, rank_};
    if (fd < 0 || !send_all(fd, &h, sizeof(h))) {
      if (fd >= 0) close(fd);
      return false;
    }
    fds_[static_cast<size_t>(peer)] = fd;
  }
  for (int pending = nranks_ - 1 - rank_; pending > 0;) {
    if (aborted()) return false;
    int fd = listener_.accept_one();
    if (fd < 0) return false;
    Hello h{};
    if (!recv_all(fd, &h, sizeof(h)) || h.nonce != nonce || h.rank <= rank_ || h.rank >= nranks_ ||
        fds_[static_cast<size_t>(h.rank)] >= 0) {
      close(fd);
      continue;
    }
    fds_[static_cast<size_t>(h.rank)] = fd;
    --pending;
  }
  for (int fd : fds_)
    if (fd >= 0) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  return !aborted();
}

namespace {
// Progress of the in-order message queue in one direction with one peer.
struct Lane {
  std::deque<Transfer> queue;
  uint64_t header = 0;  // length prefix being sent or received
  size_t done = 0;      // bytes of header+payload transferred for queue.front()
  bool header_checked = false;
};
}  // namespace

ExchangeStatus PeerMesh::exchange(const std::vector<Transfer>& transfers) {
  std::vector<Lane> sends(static_cast<size_t>(nranks_)), recvs(static_cast<size_t>(nranks_));
  for (const Transfer& t : transfers) (t.is_send ? sends : recvs)[static_cast<size_t>(t.peer)].queue.push_back(t);
  constexpr size_t kHdr = sizeof(uint64_t);
  for (;;) {
    if (aborted()) return ExchangeStatus::Aborted;
    std::vector<pollfd> pfds;
    std::vector<int> peers;
    for (int p = 0; p < nranks_; ++p) {
      short ev = 0;
      if (!sends[static_cast<size_t>(p)].queue.empty()) ev |= POLLOUT;
      if (!recvs[static_cast<size_t>(p)].queue.empty()) ev |= POLLIN;
      if (ev) {
        pfds.push_back(pollfd{fds_[static_cast<size_t>(p)], ev, 0});
        peers.push_back(p);
      }
    }
    if (pfds.empty()) return ExchangeStatus::Ok;
    pfds.push_back(pollfd{abort_pipe_[0], POLLIN, 0});
    if (poll(pfds.data(), pfds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      return ExchangeStatus::PeerLost;
    }
    if (pfds.back().revents) return ExchangeStatus::Aborted;
    for (size_t i = 0; i + 1 < pfds.size(); ++i) {
      const int p = peers[i], fd = pfds[i].fd;
      const short rev = pfds[i].revents;
      Lane& out = sends[static_cast<size_t>(p)];
      if ((rev & (POLLOUT | POLLERR | POLLHUP)) && !out.queue.empty()) {
        const Transfer& t = out.queue.front();
        out.header = t.len;
        const bool in_header = out.done < kHdr;
        const char* src = in_header ? reinterpret_cast<const char*>(&out.header) + out.done
                                    : static_cast<const char*>(t.buf) + (out.done - kHdr);
        const size_t want = in_header ? kHdr - out.done : t.len - (out.done - kHdr);
        ssize_t n = want ? send(fd, src, want, MSG_NOSIGNAL | MSG_DONTWAIT) : 0;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ExchangeStatus::PeerLost;
        if (n > 0) out.done += static_cast<size_t>(n);
        if (out.done == kHdr + t.len) {
          out.queue.pop_front();
          out.done = 0;
        }
      }
      Lane& in = recvs[static_cast<size_t>(p)];
      if ((rev & (POLLIN | POLLERR | POLLHUP)) && !in.queue.empty()) {
        const Transfer& t = in.queue.front();
        const bool in_header = in.done < kHdr;
        char* dst = in_header ? reinterpret_cast<char*>(&in.header) + in.done
                              : static_cast<char*>(t.buf) + (in.done - kHdr);
        const size_t want = in_header ? kHdr - in.done : t.len - (in.done - kHdr);
        ssize_t n = want ? recv(fd, dst, want, MSG_DONTWAIT) : 0;
        if (n == 0 && want) return ExchangeStatus::PeerLost;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return ExchangeStatus::PeerLost;
        if (n > 0) in.done += static_cast<size_t>(n);
        if (in.done >= kHdr && !in.header_checked) {
          if (in.header != t.len) return ExchangeStatus::SizeMismatch;
          in.header_checked = true;
        }
        if (in.done == kHdr + t.len && in.header_checked) {
          in.queue.pop_front();
          in.done = 0;
          in.header_checked = false;
        }
      }
    }
  }
}

void PeerMesh::wait_for_abort() {
  pollfd p{abort_pipe_[0], POLLIN, 0};
  while (!aborted()) poll(&p, 1, -1);
}

void PeerMesh::abort() {
  aborted_.store(true);
  const char b = 1;
  (void)!write(abort_pipe_[1], &b, 1);  // never drained: every later poll sees it
  listener_.shut();
  for (int fd : fds_)
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

}  // namespace simcuda::nccl
