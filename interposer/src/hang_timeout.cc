#include "hang_timeout.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace jitckpt {
namespace {

bool positive_finite(const std::string& s, double* out) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0) return false;
  *out = v;
  return true;
}

bool positive_int(const std::string& s, int* out) {
  char* end = nullptr;
  long v = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || v < 1 || v > 1000000) return false;
  *out = static_cast<int>(v);
  return true;
}

}  // namespace

std::optional<HangTimeoutPolicy> HangTimeoutPolicy::parse(const std::string& raw, std::string* error) {
  std::string text = raw;
  text.erase(0, text.find_first_not_of(" \t"));
  text.erase(text.find_last_not_of(" \t") + 1);
  HangTimeoutPolicy p;
  if (text == "auto" || text.rfind("auto:", 0) == 0) {
    size_t pos = text.size() > 5 ? 5 : text.size();
    while (pos < text.size()) {
      size_t comma = text.find(',', pos);
      std::string part = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      pos = comma == std::string::npos ? text.size() : comma + 1;
      if (part.empty()) continue;
      size_t eq = part.find('=');
      std::string key = part.substr(0, eq), val = eq == std::string::npos ? "" : part.substr(eq + 1);
      bool ok = (key == "floor" && positive_finite(val, &p.floor_s)) ||
                ((key == "mult" || key == "multiplier") && positive_finite(val, &p.multiplier)) ||
                (key == "startup" && positive_finite(val, &p.startup_s)) ||
                (key == "window" && positive_int(val, &p.window)) ||
                (key == "warmup" && positive_int(val, &p.warmup));
      if (!ok) {
        *error = "bad hang timeout option '" + part + "' in '" + text +
                 "': use auto:floor=S,mult=X,startup=S,window=N,warmup=N (positive numbers)";
        return std::nullopt;
      }
    }
    return p;
  }
  if (!positive_finite(text, &p.fixed_s)) {
    *error = "hang timeout '" + text + "': expected a finite number of seconds > 0 or 'auto[:floor=S,mult=X]'";
    return std::nullopt;
  }
  p.adaptive = false;
  return p;
}

std::string HangTimeoutPolicy::text() const {
  char buf[160];
  if (!adaptive) {
    std::snprintf(buf, sizeof buf, "%.12g", fixed_s);
  } else {
    std::snprintf(buf, sizeof buf, "auto:floor=%.12g,mult=%.12g,startup=%.12g,window=%d,warmup=%d", floor_s, multiplier,
                  startup_s, window, warmup);
  }
  return buf;
}

void HangTimeout::set(const HangTimeoutPolicy& policy) {
  std::lock_guard<std::mutex> lock(mu_);
  policy_ = policy;
  recent_.clear();
}

HangTimeoutPolicy HangTimeout::policy() const {
  std::lock_guard<std::mutex> lock(mu_);
  return policy_;
}

double HangTimeout::current() const {
  std::lock_guard<std::mutex> lock(mu_);
  const HangTimeoutPolicy& p = policy_;
  if (!p.adaptive) return p.fixed_s;
  if (static_cast<int>(recent_.size()) < p.warmup) return std::max(p.floor_s, p.startup_s);
  return std::max(p.floor_s, p.multiplier * *std::max_element(recent_.begin(), recent_.end()));
}

void HangTimeout::record(double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!policy_.adaptive || !std::isfinite(seconds) || seconds < 0) return;
  recent_.push_back(seconds);
  while (static_cast<int>(recent_.size()) > policy_.window) recent_.pop_front();
}

}  // namespace jitckpt
