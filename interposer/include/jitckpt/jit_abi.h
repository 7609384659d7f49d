// C ABI of libjit.so, consumed by the jitckpt._native Python module (found with
// dlsym(RTLD_DEFAULT, "jitckpt_api_v1") so the module also loads when libjit.so is not preloaded).
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JITCKPT_ABI_VERSION 4u

// Called on the watchdog thread, once per detected failure, while device copies are redirected to a
// fresh stream. `kind` is one of "hang", "nccl_error", "nccl_async_error", "cuda_error", "manual".
// Returns 0 to end save mode (redirection) on return, non-zero to keep it on until the process
// exits (the save continues on another thread).
typedef int (*jitckpt_failure_handler)(const char* kind, const char* detail, void* ctx);

typedef struct jitckpt_api {
  unsigned abi_version;  // JITCKPT_ABI_VERSION
  // mode: "observe" (the only mode so far). hang_timeout: "S" seconds or "auto[:floor=S,mult=X,
  // startup=S,window=N,warmup=N]" as $JITCKPT_HANG_TIMEOUT (v4; was a double); NULL or "" keeps the
  // current policy. Returns 0, or -1 with a message in err.
  int (*configure)(const char* mode, const char* hang_timeout, char* err, size_t err_len);
  void (*mark_minibatch)(int64_t step);
  void (*set_phase)(const char* phase);
  // Writes a JSON object (NUL-terminated, truncated to cap) and returns its full length.
  size_t (*status_json)(char* buf, size_t cap);
  void (*set_failure_handler)(jitckpt_failure_handler fn, void* ctx);
  // Reports a failure as if the watchdog had detected it (tests, and the runtime's own detections).
  void (*trigger_failure)(const char* kind, const char* detail);
  // Non-zero while the calling thread is inside an intercepted blocking CUDA/NCCL call
  // (async-signal-safe: reads an initial-exec thread-local).
  int (*in_blocking_call)(void);
  // Ends save mode (redirection) now; for a handler that lets blocked threads resume before returning.
  void (*end_save_mode)(void);
  // Marks (on != 0) or unmarks the calling thread as a save thread: while save mode is on, only save
  // threads' device work is redirected to the save stream (the watchdog thread is marked while the
  // handler runs). Other threads keep the application's streams and block behind a hung one.
  void (*set_save_thread)(int on);
  // v3, the send log ($JITCKPT_SEND_LOG_DIR; no-ops without it). What the next ncclSend calls carry:
  // iteration, micro-batch, payload ("activation" forward, "gradient" backward).
  void (*set_log_context)(int64_t iteration, int micro_batch, const char* payload);
  // Waits at most timeout_s until every logged send is in a file. Returns 0, or -1 with the reason.
  int (*flush_send_log)(double timeout_s, char* err, size_t err_len);
  // Deletes the chunk files holding only iterations <= iteration; returns how many.
  int (*drop_send_logs_through)(int64_t iteration);
} jitckpt_api;

const jitckpt_api* jitckpt_api_v1(void);

#ifdef __cplusplus
}
#endif
