// The single registry of libjit.so: configuration, training markers, what was learned about streams
// and collectives, the failure latch, the save redirect, the watchdog, and SWIFT's send log and receive replay. Created on first use and
// never destroyed (the watchdog thread may outlive static destructors at exit).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>

#include "collective_tracker.h"
#include "failure_latch.h"
#include "hang_timeout.h"
#include "jitckpt/jit_abi.h"
#include "log_context.h"
#include "proxy_session.h"
#include "recv_replay.h"
#include "save_redirect.h"
#include "send_log.h"
#include "stream_graph.h"
#include "watchdog.h"

namespace jitckpt {

class Registry {
 public:
  static Registry& instance() {
    static Registry* const registry = new Registry();
    return *registry;
  }

  StreamGraph& graph() { return graph_; }
  CollectiveTracker& collectives() { return collectives_; }
  SaveRedirect& redirect() { return redirect_; }
  FailureLatch& failures() { return failures_; }
  Watchdog& watchdog() { return watchdog_; }
  LogContext& log_context() { return log_context_; }
  SendLog& send_log() { return send_log_; }
  RecvReplay& recv_replay() { return recv_replay_; }
  ProxySession& proxy() { return proxy_; }

  // False in a child forked after libjit.so was active: it has no watchdog and its copies of the
  // mutexes may be locked, so NCCL calls there pass through untracked.
  bool tracking() const { return !forked_child_.load(std::memory_order_relaxed); }

  // hang_timeout: the policy's text (see hang_timeout.h); empty keeps the current one.
  bool configure(const std::string& mode, const std::string& hang_timeout, std::string* error);
  double hang_timeout() const { return hang_timeout_.current(); }
  HangTimeout& hang_timeouts() { return hang_timeout_; }

  // A minibatch starts (the Python runtime's step, or jitckpt_mark_minibatch()): also proxy mode's
  // replay journal starts over (see ReplayJournal).
  void mark_minibatch(int64_t step);
  int64_t step() const { return step_.load(std::memory_order_relaxed); }
  // "optimizer" starts the optimizer step for proxy mode's journal too.
  void set_phase(std::string phase);
  std::string phase() const;

  void set_failure_handler(jitckpt_failure_handler fn, void* ctx);
  std::pair<jitckpt_failure_handler, void*> failure_handler() const;
  // `phase`: the phase the failed work was posted in (a hung collective's), if not the current one;
  // a failure in the optimizer phase means the parameters may be partly updated.
  void report_failure(const char* kind, const std::string& detail, const std::string& phase = "");
  // An application thread hit the failure synchronously (it may hold the GIL and is about to surface
  // the error): report it and, if a handler is registered, hold the thread until it has run.
  void report_failure_and_hold(const char* kind, const std::string& detail);

  std::string status_json();
  // True while the JIT handler runs (with or without a working save redirect).
  void set_saving(bool on) { saving_.store(on); }
  void end_save_mode() {
    redirect_.end();
    saving_.store(false);
  }
  bool saving() const { return saving_.load(); }

 private:
  Registry();

  StreamGraph graph_;
  CollectiveTracker collectives_;
  SaveRedirect redirect_;
  FailureLatch failures_;
  Watchdog watchdog_{*this};
  LogContext log_context_;
  SendLog send_log_;
  RecvReplay recv_replay_;
  ProxySession proxy_;

  HangTimeout hang_timeout_;
  std::atomic<int64_t> step_{-1};
  std::atomic<bool> forked_child_{false};
  std::atomic<bool> saving_{false};

  mutable std::mutex mu_;  // phase and handler; never held across a CUDA/NCCL call or the handler
  std::string phase_ = "unknown";
  jitckpt_failure_handler handler_ = nullptr;
  void* handler_ctx_ = nullptr;
};

}  // namespace jitckpt
