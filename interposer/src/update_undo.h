// The undo plugin of proxy mode (`jitckpt run --transparent --plugin undo`; SWIFT update-undo,
// issue 16 case 4; include/jitckpt/undo.h is the program's side). A failure inside the optimizer
// step of a proxy that still runs leaves the parameters and optimizer state partly updated on every
// rank. The program registers an inverse kernel for each kernel of its optimizer step; this class
// knows, per minibatch, which of those kernels the old proxy had run, and gives the recovery their
// inverse launches, newest first, to run in the new proxy on the restored buffers before the
// minibatch is replayed from its start.
//
// Which launches ran: an event of its own is recorded behind each launch of the optimizer step. A
// launch is undone if it was posted before the failed call (a fenced proxy runs nothing posted
// after it) and its event completed (a launch queued behind a hung collective never ran).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "journal_replay.h"
#include "proxy_client.h"
#include "replay_journal.h"

namespace jitckpt {

// cudaEventQuery on the proxy behind `ch`, directly on the channel: for callers holding the
// session's recovery lock, which a forwarded call would take again. Its cudaError_t, or 999 with
// `error` when the proxy did not answer.
int query_event(proxy::ProxyChannel& ch, cudaEvent_t event, std::string* error);

class UpdateUndo {
 public:
  UpdateUndo();  // on with "undo" in $JITCKPT_PLUGINS (`jitckpt run --plugin undo`)
  UpdateUndo(const UpdateUndo&) = delete;
  UpdateUndo& operator=(const UpdateUndo&) = delete;

  bool enabled() const { return enabled_; }
  // jitckpt_register_inverse(): the proxy's ids of a kernel and of its inverse (-1: it writes
  // nothing that outlives the minibatch).
  void add(uint32_t kernel, int64_t inverse);
  // Minibatch marks.
  void minibatch();
  void optimizer_step() { optimizer_.store(true, std::memory_order_relaxed); }
  bool in_optimizer_step() const { return enabled_ && optimizer_.load(std::memory_order_relaxed); }
  // After the launch with journal id `id` of kernel `kernel` (`name`) on `stream` in the optimizer
  // step: records an event behind it (through the proxy; no lock of the session is held).
  void launched(int64_t id, uint32_t kernel, const std::string& name, cudaStream_t stream);
  // The inverse launches of this minibatch's optimizer-step launches with a journal id below
  // `before` that had run on the proxy behind `ch`, newest first (what its events say; call it
  // after the proxy finished or stopped its work). False with `why`: a kernel that ran has no
  // inverse registered, or the launches cannot be told.
  bool plan(proxy::ProxyChannel& ch, const ReplayJournal& journal, int64_t before, std::vector<UndoLaunch>* out,
            std::string* why) const;

 private:
  struct Launch {
    int64_t id;  // in the journal
    uint32_t kernel;
    std::string name;
    cudaEvent_t done;  // nullptr: no event could be recorded behind it
  };

  const bool enabled_;
  std::atomic<bool> optimizer_{false};
  mutable std::mutex mu_;
  std::map<uint32_t, int64_t> inverses_;  // kernel -> inverse kernel (-1: nothing to undo)
  std::vector<Launch> launches_;         // this minibatch's, in the optimizer step
  std::vector<cudaEvent_t> events_;      // every event made; launches_ use the first ones
};

}  // namespace jitckpt
