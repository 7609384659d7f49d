// Failure injection for collectives, configured by SIMCUDA_FAIL_* (see simcuda/README.md).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace simcuda::nccl {

enum class FaultMode { None, Hang, Error, Sticky, Crash };

class FaultPlan {
 public:
  // Reads SIMCUDA_FAIL_RANK / SIMCUDA_FAIL_AT / SIMCUDA_FAIL_MODE once per process.
  static FaultPlan& get();
  // Empty when the configuration is valid; otherwise a message naming the bad variable and the fix.
  const std::string& config_error() const { return error_; }
  // Called once per collective or point-to-point call made on a communicator where this process
  // has user rank `rank`. Returns the fault to inject for this call (None almost always).
  FaultMode on_call(int rank);

 private:
  FaultPlan();
  FaultMode mode_ = FaultMode::None;
  bool any_rank_ = false;
  int rank_ = -1;
  uint64_t at_ = 0;
  std::atomic<uint64_t> count_{0};
  std::string once_;  // SIMCUDA_FAIL_ONCE: a marker file; the fault fires only where it creates it
  std::string error_;
};

}  // namespace simcuda::nccl
