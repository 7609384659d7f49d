// The first failure reported in this process, from detection until the JIT handler has run.
// Later reports are ignored: one failure leads to one save, then the runtime exits the process.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

namespace jitckpt {

struct Failure {
  std::string kind;
  std::string detail;
  double unix_time = 0;
  int64_t step = -1;
  std::string phase;
};

class FailureLatch {
 public:
  // Returns true if this is the first report (it will be dispatched).
  bool report(Failure f);
  // Watchdog side: waits up to `timeout` for an undispatched report and claims it.
  std::optional<Failure> wait_for_report(std::chrono::steady_clock::duration timeout);
  void mark_handled();
  // Blocks the calling thread until the reported failure has been handled (see nccl_hooks).
  void wait_handled();
  std::optional<Failure> last() const;
  bool triggered() const;
  bool handled() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Failure> failure_;
  bool claimed_ = false;
  bool handled_ = false;
};

}  // namespace jitckpt
