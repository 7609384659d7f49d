// SWIFT replay at the NCCL level, for a replacement pipeline stage: until it has caught up with the
// survivors, its ncclRecv calls are served from its neighbours' send logs (send_log.h) instead of
// the network, and its ncclSend calls are dropped (the survivors received those messages before
// the failure; the send log still records them, so this stage's log is whole again). The
// survivors do not roll back.
//
// On with $JITCKPT_RECV_REPLAY_DIRS (the neighbours' log directories, ':'-separated) and
// $JITCKPT_RECV_REPLAY_THROUGH (the last iteration to replay): a call whose LogContext iteration
// is <= that is replayed, later ones go to NCCL. In proxy mode a replacement stage
// ($JITCKPT_STAGE_JOIN=1) learns the last iteration from the survivors as it joins (stage_join.h),
// and its first call past it is recorded in the job's event log ("stage_caught_up"). A message that is not in the logs, has another
// type or size, or comes out of its sender's original order fails the call (ncclInvalidUsage,
// reported like any NCCL error), never a silent substitute.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "log_context.h"

namespace jitckpt {

class JsonWriter;

class RecvReplay {
 public:
  RecvReplay();  // reads the environment; loads the logs on first use
  RecvReplay(const RecvReplay&) = delete;
  RecvReplay& operator=(const RecvReplay&) = delete;

  bool enabled() const { return enabled_; }  // fixed at construction
  bool replaying(const LogContext::Value& ctx) const {
    return enabled_ && ctx.iteration <= through_.load(std::memory_order_acquire);
  }
  void set_through(int64_t iteration) { through_.store(iteration, std::memory_order_release); }
  // A send or receive that goes to NCCL (not replayed), with the context it carries: the first one
  // past the replayed iterations is the stage's catching up, said once in the event log.
  void went_live(const LogContext::Value& ctx);
  // Enqueues on `stream` a host-to-device copy of the logged message the ncclRecv asks for.
  ncclResult_t serve(const LogContext::Value& ctx, void* buf, size_t count, ncclDataType_t dtype, int peer,
                     ncclComm_t comm, cudaStream_t stream);
  void dropped_send();
  void write_status(JsonWriter& w) const;

 private:
  using Key = std::tuple<int64_t, int, std::string, int, int>;  // iteration, micro-batch, payload, src, dst
  struct Message {
    int generation = 0;
    int64_t seq = 0;
    std::string dtype;
    std::vector<char> bytes;  // kept until exit: a queued copy may still read them
  };

  bool load();  // mu_ held
  ncclResult_t fail(const std::string& why);  // mu_ held

  bool enabled_ = false;
  std::atomic<int64_t> through_{-1};
  std::atomic<bool> live_{false};
  int64_t first_served_ = -1;  // the first iteration replayed
  std::vector<std::string> dirs_;

  mutable std::mutex mu_;  // never held across a CUDA or NCCL call
  bool loaded_ = false;
  std::map<Key, Message> messages_;
  std::map<int, std::pair<int, int64_t>> last_taken_;  // per sender: (generation, seq)
  int64_t served_ = 0, dropped_sends_ = 0;
  std::string error_;
};

}  // namespace jitckpt
