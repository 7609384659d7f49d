#include "fault_plan.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace simcuda::nccl {

FaultPlan& FaultPlan::get() {
  static FaultPlan* plan = new FaultPlan();  // never destroyed: read by stream workers until exit
  return *plan;
}

FaultPlan::FaultPlan() {
  const char* mode = std::getenv("SIMCUDA_FAIL_MODE");
  const char* rank = std::getenv("SIMCUDA_FAIL_RANK");
  const char* at = std::getenv("SIMCUDA_FAIL_AT");
  if (!mode || !*mode) {
    if ((rank && *rank) || (at && *at))
      error_ = "SIMCUDA_FAIL_RANK/SIMCUDA_FAIL_AT are set but SIMCUDA_FAIL_MODE is not; set "
               "SIMCUDA_FAIL_MODE=hang|error|sticky|crash or unset them";
  } else {
    if (!std::strcmp(mode, "hang")) mode_ = FaultMode::Hang;
    else if (!std::strcmp(mode, "error")) mode_ = FaultMode::Error;
    else if (!std::strcmp(mode, "sticky")) mode_ = FaultMode::Sticky;
    else if (!std::strcmp(mode, "crash")) mode_ = FaultMode::Crash;
    else error_ = std::string("SIMCUDA_FAIL_MODE='") + mode + "' is invalid; use hang, error, sticky or crash";
    if (!rank || !*rank || !std::strcmp(rank, "*") || !std::strcmp(rank, "all")) {
      any_rank_ = true;
    } else {
      char* end = nullptr;
      long r = std::strtol(rank, &end, 10);
      if (*end || r < 0) error_ = std::string("SIMCUDA_FAIL_RANK='") + rank + "' is invalid; use a rank >= 0 or '*'";
      rank_ = static_cast<int>(r);
    }
    char* end = nullptr;
    long long n = at && *at ? std::strtoll(at, &end, 10) : 1;
    if ((at && *at && *end) || n < 1)
      error_ = std::string("SIMCUDA_FAIL_AT='") + (at ? at : "") + "' is invalid; use N >= 1 (the Nth collective)";
    at_ = static_cast<uint64_t>(n);
    if (const char* once = std::getenv("SIMCUDA_FAIL_ONCE"); once && *once) once_ = once;
  }
  if (!error_.empty()) {
    std::fprintf(stderr, "simcuda: %s\n", error_.c_str());
    mode_ = FaultMode::None;
  }
}

FaultMode FaultPlan::on_call(int rank) {
  if (mode_ == FaultMode::None || (!any_rank_ && rank != rank_)) return FaultMode::None;
  if (count_.fetch_add(1) + 1 != at_) return FaultMode::None;
  if (!once_.empty()) {
    // A transient fault happens once: the first process to create the marker file fails, any
    // process after it (a restarted one replaying the same calls) does not.
    const int fd = open(once_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
    if (fd < 0) {
      if (errno != EEXIST) std::fprintf(stderr, "simcuda: SIMCUDA_FAIL_ONCE=%s: %s\n", once_.c_str(), std::strerror(errno));
      return FaultMode::None;
    }
    close(fd);
  }
  return mode_;
}

}  // namespace simcuda::nccl
