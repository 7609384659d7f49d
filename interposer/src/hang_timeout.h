// How long a collective may run before it counts as hung: fixed seconds, or adaptive ("auto"), a
// multiple of the longest recent collective, never below a floor, with a start-up value until
// `warmup` collectives have completed (the first ones wait for every rank's start-up and restore).
// Grammar and defaults are those of jitckpt.hang_timeout.HangTimeout, so `jitckpt run
// --hang-timeout X` and JITCKPT_HANG_TIMEOUT=X mean the same in Python and here.
#pragma once

#include <deque>
#include <mutex>
#include <optional>
#include <string>

namespace jitckpt {

struct HangTimeoutPolicy {
  bool adaptive = true;
  double fixed_s = 0;
  double floor_s = 30;
  double multiplier = 10;
  double startup_s = 120;
  int window = 64;
  int warmup = 3;

  // "30", "auto" or "auto:floor=S,mult=X,startup=S,window=N,warmup=N"; nullopt with the reason.
  static std::optional<HangTimeoutPolicy> parse(const std::string& text, std::string* error);
  std::string text() const;  // parse(text()) gives this policy back
};

class HangTimeout {
 public:
  void set(const HangTimeoutPolicy& policy);  // forgets the recorded durations
  HangTimeoutPolicy policy() const;
  double current() const;         // seconds a collective may run now
  void record(double seconds);    // a completed collective's duration (used when adaptive)

 private:
  mutable std::mutex mu_;
  HangTimeoutPolicy policy_;
  std::deque<double> recent_;
};

}  // namespace jitckpt
