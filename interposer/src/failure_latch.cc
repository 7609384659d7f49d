#include "failure_latch.h"

namespace jitckpt {

bool FailureLatch::report(Failure f) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) return false;
    failure_ = std::move(f);
  }
  cv_.notify_all();
  return true;
}

std::optional<Failure> FailureLatch::wait_for_report(std::chrono::steady_clock::duration timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return failure_ && !claimed_; });
  if (!failure_ || claimed_) return std::nullopt;
  claimed_ = true;
  return failure_;
}

void FailureLatch::mark_handled() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    handled_ = true;
  }
  cv_.notify_all();
}

void FailureLatch::wait_handled() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return handled_; });
}

std::optional<Failure> FailureLatch::last() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

bool FailureLatch::triggered() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_.has_value();
}

bool FailureLatch::handled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return handled_;
}

}  // namespace jitckpt
