// Full mesh of loopback TCP connections between the ranks of one communicator, with an abort switch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "loopback_socket.h"

namespace simcuda::nccl {

// One message to or from a peer. Messages between a pair are matched in order; each carries its
// length so a mismatched pair of calls is detected instead of corrupting data.
struct Transfer {
  int peer;
  bool is_send;
  void* buf;
  size_t len;
};

enum class ExchangeStatus { Ok, Aborted, PeerLost, SizeMismatch };

class PeerMesh {
 public:
  PeerMesh(int rank, int nranks);
  ~PeerMesh();
  PeerMesh(const PeerMesh&) = delete;
  PeerMesh& operator=(const PeerMesh&) = delete;

  uint16_t listen_port() const { return listener_.port(); }
  // Connects to every peer (lower ranks dial, higher ranks are accepted). False on failure/abort.
  bool connect(const std::vector<uint16_t>& ports, uint64_t nonce);
  // Progresses all transfers concurrently until done. Blocks with no timeout: a stopped peer stalls
  // it forever, exactly like a collective on a GPU; only abort() ends the wait early.
  ExchangeStatus exchange(const std::vector<Transfer>& transfers);
  // Blocks until abort() (used to hang like a GPU after a lost peer or an injected hang).
  void wait_for_abort();
  // Wakes every blocked exchange/wait and makes all later ones return Aborted at once.
  void abort();
  bool aborted() const { return aborted_.load(); }

 private:
  int rank_;
  int nranks_;
  Listener listener_;
  std::vector<int> fds_;  // by peer rank; -1 for self
  int abort_pipe_[2] = {-1, -1};
  std::atomic<bool> aborted_{false};
};

}  // namespace simcuda::nccl
