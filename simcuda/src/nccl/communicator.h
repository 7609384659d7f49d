// A simulated NCCL communicator: one rank's view of a group of processes joined by a PeerMesh.
#pragma once

#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collective.h"
#include "peer_mesh.h"
#include "rendezvous.h"

namespace simcuda::nccl {

class Communicator {
 public:
  Communicator(int nranks, int rank, int device, RendezvousId id);

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }
  int device() const { return device_; }

  // Rendezvous and mesh setup; blocking. Sets the async error to the outcome.
  ncclResult_t initialize();
  // Marks that initialize() will run (on another thread), so abort() waits for it.
  void init_started();
  // ncclInProgress while a non-blocking init runs, then the first asynchronous error (or success).
  ncclResult_t async_error() const { return async_error_.load(); }
  void set_async_error(ncclResult_t e);

  // Runs a batch on the calling (stream worker) thread. Blocks for as long as peers do; a lost peer
  // makes it wait for abort() forever instead of failing, like a collective on a GPU.
  void execute(const std::vector<Collective>& batch);
  // Blocks until abort() (failure injection "hang").
  void hang_until_abort();
  // Unblocks everything (init included) and waits until a running initialize() has returned.
  void abort();

  // Host-side all-gather of `bytes` per rank into `all` (rank order), for ncclCommSplit. Waits for
  // this communicator's queued stream work first, so it never interleaves with a collective.
  bool allgather_host(const void* mine, void* all, size_t bytes);

  // Outstanding stream operations, for ncclCommFinalize.
  void op_enqueued();
  void op_finished();
  void wait_idle();

 private:
  bool wait_initialized();  // false if init failed or the communicator was aborted
  ExchangeStatus run(const Collective& c);
  ExchangeStatus run_p2p(const std::vector<Collective>& batch);
  void reduce_in_rank_order(std::vector<const void*>& inputs, void* out, size_t count, const Collective& c);

  const int nranks_, rank_, device_;
  const RendezvousId id_;
  PeerMesh mesh_;
  BootstrapSocket bootstrap_;
  std::atomic<ncclResult_t> async_error_{ncclInProgress};
  std::mutex exec_mu_;  // one batch at a time: messages between two ranks must stay in call order
  std::mutex state_mu_;
  std::condition_variable state_cv_;
  bool initialized_ = false;
  bool init_running_ = false;
  ncclResult_t init_result_ = ncclInProgress;  // async errors later do not undo a good init
  long outstanding_ = 0;
};

}  // namespace simcuda::nccl
