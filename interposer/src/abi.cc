// jitckpt_api_v1: the C ABI the Python module uses (include/jitckpt/jit_abi.h), and the minibatch
// marks native programs call (include/jitckpt/marks.h).
#include <cstring>
#include <string>

#include "jitckpt/jit_abi.h"
#include "blocking_call.h"
#include "proxy_forwarding.h"
#include "registry.h"

using jitckpt::Registry;

namespace {

int configure(const char* mode, const char* hang_timeout, char* err, size_t err_len) {
  std::string error;
  if (Registry::instance().configure(mode ? mode : "", hang_timeout ? hang_timeout : "", &error)) return 0;
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, error.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return -1;
}

void mark_minibatch(int64_t step) { Registry::instance().mark_minibatch(step); }
void set_phase(const char* phase) { Registry::instance().set_phase(phase ? phase : ""); }

size_t status_json(char* buf, size_t cap) {
  std::string s = Registry::instance().status_json();
  if (buf != nullptr && cap > 0) {
    size_t n = s.size() < cap - 1 ? s.size() : cap - 1;
    std::memcpy(buf, s.data(), n);
    buf[n] = '\0';
  }
  return s.size();
}

void set_failure_handler(jitckpt_failure_handler fn, void* ctx) {
  Registry::instance().set_failure_handler(fn, ctx);
}

void trigger_failure(const char* kind, const char* detail) {
  Registry::instance().report_failure(kind ? kind : "manual", detail ? detail : "");
}

int in_blocking_call() { return jitckpt::BlockingCallScope::active() ? 1 : 0; }

void end_save_mode() { Registry::instance().end_save_mode(); }

void set_save_thread(int on) { jitckpt::SaveThreadScope::set(on != 0); }

void set_log_context(int64_t iteration, int micro_batch, const char* payload) {
  Registry::instance().log_context().set(iteration, micro_batch, payload);
}

int flush_send_log(double timeout_s, char* err, size_t err_len) {
  std::string error;
  if (Registry::instance().send_log().flush(timeout_s, &error)) return 0;
  if (err != nullptr && err_len > 0) {
    std::strncpy(err, error.c_str(), err_len - 1);
    err[err_len - 1] = '\0';
  }
  return -1;
}

int drop_send_logs_through(int64_t iteration) { return Registry::instance().send_log().drop_through(iteration); }

constexpr jitckpt_api kApi = {JITCKPT_ABI_VERSION, configure,        mark_minibatch,
                              set_phase,           status_json,      set_failure_handler,
                              trigger_failure,     in_blocking_call, end_save_mode,
                              set_save_thread,     set_log_context,  flush_send_log,
                              drop_send_logs_through};

}  // namespace

extern "C" __attribute__((visibility("default"))) const jitckpt_api* jitckpt_api_v1(void) { return &kApi; }

// The minibatch marks of native programs (include/jitckpt/marks.h).
extern "C" __attribute__((visibility("default"))) void jitckpt_mark_minibatch(void) {
  // Not the step number: a Python runtime in the same process owns that (jitckpt_api_v1).
  Registry::instance().proxy().mark_minibatch();
  Registry::instance().set_phase("forward");
}

extern "C" __attribute__((visibility("default"))) void jitckpt_mark_optimizer_step(void) {
  Registry::instance().set_phase("optimizer");
}

// The undo plugin's inverse kernels (include/jitckpt/undo.h).
extern "C" __attribute__((visibility("default"))) int jitckpt_register_inverse(const void* kernel, const void* inverse) {
  if (!Registry::instance().proxy().enabled()) return 0;
  return jitckpt::proxy_mode::register_inverse(kernel, inverse);
}
