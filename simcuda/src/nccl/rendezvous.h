// ncclUniqueId contents and the bootstrap root that introduces the ranks of one communicator.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

namespace simcuda::nccl {

// What simcuda stores in the 128 opaque bytes of an ncclUniqueId.
struct RendezvousId {
  static constexpr uint64_t kMagic = 0x53494d4e43434c31ULL;  // "SIMNCCL1"
  uint64_t magic = kMagic;
  uint64_t nonce = 0;      // random; distinguishes communicators and rejects stray connections
  uint16_t root_port = 0;  // bootstrap root on 127.0.0.1

  ncclUniqueId encode() const;
  static std::optional<RendezvousId> decode(const ncclUniqueId& id);
};

// Starts a bootstrap root in this process (a detached thread that serves one communicator) and
// returns its id, as ncclGetUniqueId does.
RendezvousId start_bootstrap_root();

// Hello a rank sends to the root, and the port table the root sends back.
struct RankHello {
  uint64_t nonce;
  int32_t nranks;
  int32_t rank;
  uint16_t mesh_port;
};

// The socket a rank is blocked on while talking to the root, so ncclCommAbort can interrupt it.
class BootstrapSocket {
 public:
  // Takes ownership of `fd` unless interrupt() already ran (then closes it and returns false).
  bool adopt(int fd);
  void release();    // closes the adopted fd
  void interrupt();  // shuts the fd down (unblocking recv) and refuses later adopt() calls

 private:
  std::mutex mu_;
  int fd_ = -1;
  bool interrupted_ = false;
};

// Exchanges mesh ports through the root. Returns the port of every rank, or nothing on failure or
// interruption.
std::optional<std::vector<uint16_t>> exchange_ports(const RendezvousId& id, int nranks, int rank,
                                                    uint16_t my_port, BootstrapSocket& socket);

}  // namespace simcuda::nccl
