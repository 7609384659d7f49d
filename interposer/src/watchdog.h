// The watchdog thread: polls the sentinel events of in-flight collectives (cudaEventQuery, which
// never blocks) and the communicators' async errors, reports a hang when a collective outlives the
// hang timeout, and runs the JIT handler for the first reported failure. It takes only libjit.so's
// own short-held mutexes, which no thread holds across a CUDA or NCCL call.
#pragma once

#include <atomic>
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
  void dispatch(const Failure& failure);

  Registry& registry_;
  std::once_flag started_;
  std::atomic<bool> running_{false};
  static thread_local bool on_watchdog_thread_;
};

}  // namespace jitckpt
