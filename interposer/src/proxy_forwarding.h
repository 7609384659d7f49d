// What the generated forwarders (proxy_forwarders.cc) and the hand-written calls (proxy_calls.cc)
// of proxy mode are made of: a request writer, a reply reader, and how a failure becomes the
// cudaError_t / ncclResult_t the application sees.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "call_protocol.h"
#include "diagnostics.h"
#include "proxy_client.h"
#include "proxy_functions.h"
#include "proxy_session.h"
#include "registry.h"

namespace jitckpt::proxy_mode {

inline ProxySession& session() { return Registry::instance().proxy(); }

// The per-thread last errors the application reads (cudaGetLastError, ncclGetLastError).
void record_cuda_error(cudaError_t e);
void record_nccl_error(const char* text);

// Turns a call's outcome into the status type of its library.
template <typename T>
T status_of(const proxy::CallResult& r, const char* name) {
  constexpr bool cuda = std::is_same_v<T, cudaError_t>;
  int32_t s = r.status;
  if (s == 0 && r.async_status != 0) s = r.async_status;  // an earlier asynchronous failure surfaces here
  // Once the proxy is gone every call fails the same way; the session said so once.
  if (!r.error.empty() && !(r.status == 999 && session().proxy_gone()))
    log_always("proxy mode: %s: %s", name, r.error.c_str());
  if constexpr (cuda) {
    if (s != 0) record_cuda_error(static_cast<cudaError_t>(s));
    return static_cast<cudaError_t>(s);
  } else {
    if (r.status == 999 && !r.error.empty()) s = ncclSystemError;  // the transport, not NCCL, failed
    if (s != 0) record_nccl_error(r.error.empty() ? name : r.error.c_str());
    return static_cast<ncclResult_t>(s);
  }
}

// A call proxy mode does not forward: the error names the symbol and why.
template <typename T>
T refuse(const char* name, const char* why) {
  log_always("proxy mode: %s is not supported: %s", name, why);
  if constexpr (std::is_same_v<T, cudaError_t>) {
    record_cuda_error(cudaErrorNotSupported);
    return cudaErrorNotSupported;
  } else {
    record_nccl_error(why);
    return ncclInvalidUsage;
  }
}

// A refused call that returns a value, not a status (ncclTeamWorld, ncclLLA2ACalcSlots): it has no
// error to return, and a made-up value would be used silently, so the process stops here.
[[noreturn]] inline void refuse_and_abort(const char* name, const char* why) {
  log_always("proxy mode: %s is not supported: %s (it returns no status: aborting)", name, why);
  std::abort();
}

// Observe mode found no next definition (the real library lacks the symbol).
template <typename T>
T missing(const char* name) {
  log_always("%s: the CUDA runtime or NCCL loaded in this process does not define it", name);
  if constexpr (std::is_same_v<T, cudaError_t>) return cudaErrorNotSupported;
  else return ncclInvalidUsage;
}
// The same for a function that returns a value, not a status (as refuse_and_abort).
[[noreturn]] inline void missing_and_abort(const char* name) {
  log_always("%s: the CUDA runtime or NCCL loaded in this process does not define it (it returns no status: "
             "aborting)", name);
  std::abort();
}

// With --default-stream per-thread the null stream is the calling thread's default stream.
inline cudaStream_t per_thread_stream(cudaStream_t s) { return s == nullptr ? cudaStreamPerThread : s; }

class Reply {
 public:
  explicit Reply(proxy::CallResult r) : r_(std::move(r)) {}
  template <typename T>
  void result(T* p) {
    if (p == nullptr) return;
    if (at_ + sizeof *p <= r_.results.size()) std::memcpy(static_cast<void*>(p), r_.results.data() + at_, sizeof *p);
    at_ += sizeof *p;
  }
  template <typename T>
  T status() const { return status_of<T>(r_, name_); }
  void name(const char* n) { name_ = n; }
  const proxy::CallResult& raw() const { return r_; }

 private:
  proxy::CallResult r_;
  size_t at_ = 0;
  const char* name_ = "";
};

// Builds one request in a per-thread buffer (no allocation once it has grown).
class CallWriter {
 public:
  explicit CallWriter(uint32_t tag, bool no_reply) : tag_(tag), no_reply_(no_reply) {
    buf().resize(sizeof(proxy::RequestHead));
  }
  CallWriter(proxy::FunctionId id, bool no_reply)
      : CallWriter(proxy::kGenericBase + static_cast<uint32_t>(id), no_reply) {}

  template <typename T>
  void value(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes(&v, sizeof v);
  }
  template <typename T>
  void handle(T h) { value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(h))); }
  void address(const void* p) { value(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p))); }
  template <typename T>
  void result(T* p) {  // in-out: presence, then the current value
    value(static_cast<uint8_t>(p != nullptr));
    if (p != nullptr) bytes(p, sizeof *p);
  }
  template <typename T>
  void result_handle(T* p) { value(static_cast<uint8_t>(p != nullptr)); }
  // A struct read, never written, whose C strings at `strings` travel as strings (forwarding.py's
  // wire format): `valid` of its bytes (what the caller's header declared) with those cleared.
  template <typename T, size_t N>
  void with_strings(const T* p, const size_t (&strings)[N], size_t valid) {
    value(static_cast<uint8_t>(p != nullptr));
    if (p == nullptr) return;
    T copy{};
    std::memcpy(static_cast<void*>(&copy), p, std::min(valid, sizeof copy));
    for (size_t at : strings) std::memset(reinterpret_cast<char*>(&copy) + at, 0, sizeof(const char*));
    value(copy);
    for (size_t at : strings) {
      const char* text = nullptr;
      if (at + sizeof text <= valid) std::memcpy(&text, reinterpret_cast<const char*>(p) + at, sizeof text);
      value(static_cast<uint8_t>(text != nullptr));
      if (text == nullptr) continue;
      const auto n = static_cast<uint32_t>(std::strlen(text));
      value(n);
      bytes(text, n);
    }
  }
  void bytes(const void* p, size_t n) {
    auto& b = buf();
    const size_t at = b.size();
    b.resize(at + n);
    if (n) std::memcpy(b.data() + at, p, n);
  }
  // `fd`, if given, is handed over first, under `fd_token` (the request names the same token).
  // `source`: a copy from shared host memory, journaled with the bytes it reads now.
  Reply send(const char* name, int fd = -1, uint64_t fd_token = 0,
             const ProxySession::SourceCopy* source = nullptr) {
    Reply r(session().call(tag_, buf(), no_reply_, fd, fd_token, source));
    r.name(name);
    return r;
  }

 private:
  static std::vector<uint8_t>& buf() {
    thread_local std::vector<uint8_t> b;
    return b;
  }
  uint32_t tag_;
  bool no_reply_;
};

// jitckpt_register_inverse() (include/jitckpt/undo.h) in proxy mode: 0, or 1 with the reason on stderr.
int register_inverse(const void* kernel, const void* inverse);

// Generated: the proxy-mode definition of an entry point, or nullptr.
void* forwarder(const char* name);
// Hand-written: the nvcc ABI entry points that are not in the headers (__cudaLaunchKernel, ...).
void* extra_forwarder(const char* name);

}  // namespace jitckpt::proxy_mode
