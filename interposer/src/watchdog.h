// The watchdog thread: polls the sentinel events of in-flight collectives (cudaEventQuery, which
// never blocks) and the communicators' async errors, reports a hang when a collective outlives the
// hang timeout, and runs the JIT handler for the first reported failure. It takes only libjit.so's
// own short-held mutexes, which no thread holds across a CUDA or NCCL call.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>

namespace jitckpt {

class Registry;
struct Failure;

class Watchdog {
 public:
  explicit Watchdog(Registry& registry) : registry_(registry) {}
  void ensure_started();
  bool running() const { return running_.load(std::memory_order_acquire); }
  // True on the watchdog thread (which runs the handler and must never wait for it).
  static bool on_watchdog_thread() { return on_watchdog_thread_; }

 private:
  void run();
  void poll();
  // Proxy mode: a call of the application that has waited longer than the hang timeout makes the
  // watchdog ask the proxy something that never waits for device work; a proxy that does not answer
  // is hung or stopped and gets replaced (see ProxySession::call). Collectives are asked about
  // anyway; this finds a stopped proxy before the first one, or in a program without NCCL.
  void ping_proxy(double timeout);
  void dispatch(const Failure& failure);

  Registry& registry_;
  std::once_flag started_;
  std::atomic<bool> running_{false};
  std::chrono::steady_clock::time_point last_ping_{};  // the watchdog thread's own
  static thread_local bool on_watchdog_thread_;
};

}  // namespace jitckpt
