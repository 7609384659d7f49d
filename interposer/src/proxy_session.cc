#include "proxy_session.h"

#include <dlfcn.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "call_protocol.h"
#include "diagnostics.h"
#include "proxy_forwarding.h"
#include "proxy_functions.h"
#include "registry.h"

extern char** environ;

namespace jitckpt {
namespace {

// A call waits as long as the direct call would: for as long as the proxy lives (its death is
// noticed within one 20 ms slice). A synchronize behind a long step is not a failure.
constexpr auto kWhileTheProxyLives = std::chrono::hours(24 * 365);

bool mode_is_proxy() {
  const char* m = std::getenv("JITCKPT_MODE");
  return m != nullptr && std::strcmp(m, "proxy") == 0;
}

// JITCKPT_PROXY_BINARY, else next to libjit.so: <lib>/../bin (build tree) or <lib> (wheel).
std::string proxy_binary() {
  if (const char* env = std::getenv("JITCKPT_PROXY_BINARY"); env && *env) return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&proxy_binary), &info) && info.dli_fname) {
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.rfind('/') + 1);
    for (const char* rel : {"../bin/jitckpt-proxy", "jitckpt-proxy"}) {
      std::string p = dir + rel;
      if (access(p.c_str(), X_OK) == 0) return p;
    }
    return dir + "../bin/jitckpt-proxy";
  }
  return "jitckpt-proxy";
}

// The application's environment without what would make the proxy a client of itself.
std::vector<std::string> proxy_environment() {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    if (kv.rfind("JITCKPT_MODE=", 0) == 0) continue;
    if (kv.rfind("LD_PRELOAD=", 0) == 0) {
      std::string kept, item, list = kv.substr(11);
      size_t at = 0;
      while (at <= list.size()) {
        size_t end = list.find_first_of(": ", at);
        if (end == std::string::npos) end = list.size();
        item = list.substr(at, end - at);
        if (!item.empty() && item.find("libjit") == std::string::npos) kept += (kept.empty() ? "" : ":") + item;
        at = end + 1;
      }
      if (!kept.empty()) env.push_back("LD_PRELOAD=" + kept);
      continue;
    }
    env.push_back(kv);
  }
  return env;
}

}  // namespace

ProxySession::ProxySession() : enabled_(mode_is_proxy()) {}

bool ProxySession::start_locked(std::string* why) {
  if (client_) return true;
  if (!start_failure_.empty()) {
    *why = start_failure_;
    return false;
  }
  try {
    const std::vector<std::string> env = proxy_environment();
    client_ = proxy::ProxyClient::start(proxy_binary(), std::chrono::seconds(30), &env);
    log_verbose("proxy mode: jitckpt-proxy pid %d serves this process", static_cast<int>(client_->pid()));
    return true;
  } catch (const std::exception& e) {
    start_failure_ = e.what();
    log_always("proxy mode: %s (set JITCKPT_PROXY_BINARY, or JITCKPT_MODE=observe)", e.what());
    *why = start_failure_;
    return false;
  }
}

namespace {

thread_local proxy::ProxyChannel* t_channel = nullptr;

// Closes the channel of a thread other than the main one when it exits, so threads that come and go
// leave no rings and no idle proxy thread behind. The main thread's stays open: static destructors
// still make calls on it after its thread-local objects are gone.
struct ChannelCloser {
  bool armed = false;
  ~ChannelCloser() {
    if (armed && t_channel != nullptr && Registry::instance().tracking())  // not in a forked child
      Registry::instance().proxy().close_channel(t_channel);
    t_channel = nullptr;
  }
};
thread_local ChannelCloser t_closer;

}  // namespace

proxy::ProxyChannel* ProxySession::channel(std::string* why) {
  if (t_channel != nullptr) return t_channel;
  std::lock_guard<std::mutex> lock(mu_);
  if (!start_locked(why)) return nullptr;
  if (!primary_taken_) {
    primary_taken_ = true;
    t_channel = &client_->primary();
  } else {
    try {
      channels_.push_back(client_->open_channel());
    } catch (const std::exception& e) {
      *why = e.what();
      return nullptr;
    }
    t_channel = channels_.back().get();
  }
  if (static_cast<pid_t>(syscall(SYS_gettid)) != getpid()) t_closer.armed = true;
  return t_channel;
}

void ProxySession::close_channel(proxy::ProxyChannel* ch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (client_ != nullptr && client_->death().empty()) {
    const proxy::RequestHead head{ch->next_seq(), proxy::kNoReply, 0};
    // Everything the thread sent before is served first; a full ring after a second means the
    // proxy is stuck in an earlier call of this thread, and the channel stays as it is.
    if (!ch->post(static_cast<uint32_t>(proxy::Call::kCloseChannel), &head, sizeof head, std::chrono::seconds(1))
             .empty())
      return;
  }
  auto it = std::find_if(channels_.begin(), channels_.end(), [&](const auto& c) { return c.get() == ch; });
  if (it != channels_.end()) channels_.erase(it);  // the primary channel belongs to the client
}

proxy::CallResult ProxySession::call(uint32_t tag, std::vector<uint8_t>& payload, bool no_reply, int fd,
                                     uint64_t fd_token) {
  proxy::CallResult r;
  if (!Registry::instance().tracking()) {  // a forked child: the rings are its parent's
    r.status = 999;
    r.error = "a process forked from a proxy-mode process cannot make CUDA calls (the proxy is its parent's)";
    return r;
  }
  std::string why;
  proxy::ProxyChannel* ch = channel(&why);
  if (ch == nullptr) {
    r.status = 999;
    r.error = why;
    return r;
  }
  const uint64_t seq = ch->next_seq();
  const proxy::RequestHead head{seq, no_reply ? proxy::kNoReply : 0u, 0};
  std::memcpy(payload.data(), &head, sizeof head);
  if (fd >= 0 && !client_->send_fd(fd, fd_token)) {
    r.status = 999;
    r.error = "cannot hand shared memory to the proxy: " + client_->death();
  } else if (no_reply) {
    r.error = ch->post(tag, payload.data(), payload.size(), kWhileTheProxyLives);
    if (!r.error.empty()) r.status = 999;
  } else {
    r = ch->call_raw(tag, payload.data(), payload.size(), seq, kWhileTheProxyLives);
    take_async_report(r);
  }
  if (r.status == 999 && !client_->death().empty() && !death_reported_.exchange(true)) {
    log_always("proxy mode: %s; every CUDA/NCCL call of this process fails from now on (its device state "
               "was in the proxy)", client_->death().c_str());
  }
  return r;
}

void ProxySession::take_async_report(const proxy::CallResult& r) {
  if (r.async_status == 0) return;
  const char* name = proxy::call_name(r.async_call);
  log_always("proxy mode: an earlier asynchronous call failed: %s (call #%llu) returned %d", name ? name : "?",
             static_cast<unsigned long long>(r.async_seq), r.async_status);
}

void* ProxySession::pinned_hint(size_t size) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  void* hint = reinterpret_cast<void*>(next_pinned_);
  next_pinned_ += (size + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  return hint;
}

void ProxySession::add_memory(uintptr_t base, size_t size, Memory kind) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  memory_[base] = Range{size, kind};
}

bool ProxySession::remove_memory(uintptr_t base, Memory kind, size_t* size) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.find(base);
  if (it == memory_.end() || it->second.kind != kind) return false;
  if (size) *size = it->second.size;
  memory_.erase(it);
  return true;
}

ProxySession::Memory ProxySession::memory_of(const void* p, size_t count) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.upper_bound(a);
  if (it == memory_.begin()) return Memory::kPageable;
  --it;
  if (a - it->first >= it->second.size || count > it->second.size - (a - it->first)) return Memory::kPageable;
  return it->second.kind;
}

bool ProxySession::overlaps_memory(uintptr_t base, size_t size) const {
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.lower_bound(base + size);  // the first range starting at or after the end
  if (it == memory_.begin()) return false;
  --it;  // the last range starting before the end: the only one that can reach into [base, ...)
  return it->first + it->second.size > base;
}

bool proxy_mode_resolve(const char* name, void** fn) {
  if (!Registry::instance().proxy().enabled()) return false;
  *fn = proxy_mode::forwarder(name);
  if (*fn == nullptr) *fn = proxy_mode::extra_forwarder(name);
  return true;
}

}  // namespace jitckpt
