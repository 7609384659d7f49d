// NCCL collectives of this process from the host call until the device finishes them. After each
// collective is enqueued, libjit.so records its own "sentinel" event (from a pool) on the
// collective's stream; the watchdog polls those with cudaEventQuery. Own events rather than the
// application's: their lifetime is ours (no cudaEventDestroy race with the watchdog's query) and
// detection works whatever the application waits with. The mutex is never held across a CUDA or
// NCCL call, except the non-blocking ncclCommGetAsyncError poll under comms_mu_ (see poll_comms).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace jitckpt {

using Clock = std::chrono::steady_clock;

struct CollectiveRecord {
  uint64_t seq = 0;
  const char* op = "";  // string literal
  cudaStream_t stream = nullptr;
  ncclComm_t comm = nullptr;
  int device = 0;
  int64_t step = -1;
  std::string phase;
  Clock::time_point since;         // host call start, then sentinel record time
  cudaEvent_t sentinel = nullptr;  // null until the collective is enqueued on the device
  bool in_host_call = true;        // the NCCL call itself has not returned yet
};

class CollectiveTracker {
 public:
  // Host call of a collective starts (called before forwarding to NCCL).
  uint64_t begin_call(const char* op, ncclComm_t comm, cudaStream_t stream, int64_t step, std::string phase);
  // The host call returned. When `enqueued` and not inside ncclGroupStart/End, a sentinel is recorded
  // now; inside a group it is recorded at the outermost ncclGroupEnd (when NCCL really enqueues).
  void end_call(uint64_t seq, bool enqueued);
  void group_start();
  void group_end(bool enqueued);

  // Copies of the in-flight records, for the watchdog and status.
  std::vector<CollectiveRecord> snapshot() const;
  // The watchdog saw these sentinels complete: drop the records, recycle the events.
  void retire(const std::vector<uint64_t>& seqs);
  // A transparent recovery replayed them into a new proxy (issue 16): their hang clocks start now.
  void restart_clocks();
  uint64_t completed() const;
  int first_device() const;  // device of the first collective, -1 if none yet

  void add_comm(ncclComm_t comm);
  void remove_comm(ncclComm_t comm);
  size_t comm_count() const;
  // Calls fn(comm) for each known communicator while holding comms_mu_, so a concurrent
  // ncclCommDestroy/Abort (which takes comms_mu_ before forwarding) cannot free the comm mid-poll.
  void poll_comms(const std::function<void(ncclComm_t)>& fn);

 private:
  void record_sentinel(uint64_t seq);
  cudaEvent_t take_event(int device);

  mutable std::mutex mu_;
  std::vector<CollectiveRecord> in_flight_;
  std::vector<std::pair<int, cudaEvent_t>> free_events_;  // (device, event)
  uint64_t next_seq_ = 1;
  uint64_t completed_ = 0;
  int first_device_ = -1;

  mutable std::mutex comms_mu_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace jitckpt
