// Reading jitckpt's settings from the environment (the launcher passes them so).
#pragma once

#include <cstdint>
#include <cstdlib>

namespace jitckpt {

// The integer in $name, or fallback when it is unset, empty or not a whole number.
inline int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return *end == '\0' ? n : fallback;
}

}  // namespace jitckpt
