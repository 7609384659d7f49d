#include "registry.h"

#include <pthread.h>

#include <chrono>
#include <cmath>
#include <cstdlib>

#include "blocking_call.h"
#include "diagnostics.h"
#include "json_writer.h"

namespace jitckpt {

Registry::Registry() {
  if (const char* env = std::getenv("JITCKPT_HANG_TIMEOUT")) {
    std::string error;
    if (auto policy = HangTimeoutPolicy::parse(env, &error)) {
      hang_timeout_.set(*policy);
    } else {
      log_always("ignoring JITCKPT_HANG_TIMEOUT=%s (%s); using %s", env, error.c_str(),
                 hang_timeout_.policy().text().c_str());
    }
  }
  pthread_atfork(nullptr, nullptr, [] { Registry::instance().forked_child_.store(true); });
}

bool Registry::configure(const std::string& mode, const std::string& hang_timeout, std::string* error) {
  // Observe mode's hooks run in both modes; proxy mode is chosen when the process starts (the
  // first CUDA call already went to the proxy or not).
  if (mode == "proxy" && !proxy_.enabled()) {
    *error = "proxy mode is chosen at process start: set JITCKPT_MODE=proxy in the environment";
    return false;
  }
  if (mode != "observe" && mode != "proxy") {
    *error = "unknown mode '" + mode + "': libjit.so has mode='observe' and mode='proxy'";
    return false;
  }
  if (hang_timeout.empty()) return true;  // keep the current policy
  auto policy = HangTimeoutPolicy::parse(hang_timeout, error);
  if (!policy) return false;
  hang_timeout_.set(*policy);
  return true;
}

void Registry::mark_minibatch(int64_t step) {
  step_.store(step, std::memory_order_relaxed);
  proxy_.mark_minibatch();
}

void Registry::set_phase(std::string phase) {
  if (phase == "optimizer") proxy_.mark_optimizer_step();
  std::lock_guard<std::mutex> lock(mu_);
  phase_ = std::move(phase);
}

std::string Registry::phase() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_;
}

void Registry::set_failure_handler(jitckpt_failure_handler fn, void* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  handler_ = fn;
  handler_ctx_ = ctx;
}

std::pair<jitckpt_failure_handler, void*> Registry::failure_handler() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {handler_, handler_ctx_};
}

void Registry::report_failure(const char* kind, const std::string& detail, const std::string& phase) {
  Failure f;
  f.kind = kind;
  f.detail = detail;
  f.unix_time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  f.step = step();
  f.phase = phase.empty() ? this->phase() : phase;
  if (failures_.report(std::move(f))) watchdog_.ensure_started();
}

void Registry::report_failure_and_hold(const char* kind, const std::string& detail) {
  report_failure(kind, detail);
  // The thread running the handler or the save must not wait for itself.
  if (failure_handler().first == nullptr || Watchdog::on_watchdog_thread() || SaveThreadScope::marked()) return;
  BlockingCallScope blocking;  // lets the GIL hand-off pre-empt this thread while it waits
  failures_.wait_handled();
}

std::string Registry::status_json() {
  JsonWriter w;
  const auto now = Clock::now();
  w.begin_object();
  w.key("preloaded").value(true);
  w.key("mode").value(proxy_.enabled() ? "proxy" : "observe");
  w.key("hang_timeout").value(hang_timeout());
  w.key("hang_timeout_policy").value(hang_timeout_.policy().text());
  w.key("step").value(step());
  w.key("phase").value(phase());
  w.key("watchdog_running").value(watchdog_.running());
  w.key("saving").value(saving());
  w.key("redirect_active").value(redirect_.active());
  w.key("nccl_streams").begin_array();
  for (cudaStream_t s : graph_.nccl_streams().snapshot()) w.value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s)));
  w.end_array();
  w.key("dependent_streams").begin_array();
  for (cudaStream_t s : graph_.dependent_streams().snapshot())
    w.value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(s)));
  w.end_array();
  w.key("communicators").value(static_cast<uint64_t>(collectives_.comm_count()));
  w.key("collectives_completed").value(collectives_.completed());
  w.key("in_flight").begin_array();
  for (const CollectiveRecord& r : collectives_.snapshot()) {
    w.begin_object();
    w.key("seq").value(r.seq);
    w.key("op").value(r.op);
    w.key("stream").value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(r.stream)));
    w.key("step").value(r.step);
    w.key("phase").value(r.phase);
    w.key("in_host_call").value(r.in_host_call);
    w.key("age_s").value(std::chrono::duration<double>(now - r.since).count());
    w.end_object();
  }
  w.end_array();
  w.key("last_error");
  if (auto f = failures_.last()) {
    w.begin_object();
    w.key("kind").value(f->kind);
    w.key("detail").value(f->detail);
    w.key("time").value(f->unix_time);
    w.key("step").value(f->step);
    w.key("phase").value(f->phase);
    w.key("handled").value(failures_.handled());
    w.end_object();
  } else {
    w.null();
  }
  w.key("transparent");
  proxy_.write_status(w);
  w.key("send_log");
  send_log_.write_status(w);
  w.key("recv_replay");
  recv_replay_.write_status(w);
  w.end_object();
  return w.str();
}

}  // namespace jitckpt
