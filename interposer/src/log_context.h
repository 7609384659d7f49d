// What the application says its next point-to-point messages carry (SWIFT's message key without
// src/dst): iteration, micro-batch, payload. Set through the C ABI (set_log_context); read by the
// send log and the receive replay. libjit.so cannot infer it from NCCL calls.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace jitckpt {

class LogContext {
 public:
  struct Value {
    int64_t iteration = 0;
    int micro_batch = 0;
    std::string payload = "activation";
  };

  void set(int64_t iteration, int micro_batch, const char* payload) {
    std::lock_guard<std::mutex> lock(mu_);
    value_ = Value{iteration, micro_batch, payload != nullptr ? payload : ""};
  }
  Value get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return value_;
  }

 private:
  mutable std::mutex mu_;
  Value value_;
};

}  // namespace jitckpt
