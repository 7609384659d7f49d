#include "diagnostics.h"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>

namespace jitckpt {
namespace {

bool verbose_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("JITCKPT_VERBOSE");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return enabled;
}

// " rank R" of a worker (torchrun's RANK), read once: the same prefix as the Python runtime's lines.
const char* rank_text() {
  static const std::string text = [] {
    const char* r = std::getenv("RANK");
    return r != nullptr && r[0] != '\0' ? std::string(" rank ") + r : std::string();
  }();
  return text.c_str();
}

void vlog(const char* fmt, va_list ap) {
  // One write() per line so lines of concurrent ranks do not interleave.
  char line[1024];
  char clock[16] = "";
  const time_t now = time(nullptr);
  struct tm local;
  if (localtime_r(&now, &local) != nullptr) strftime(clock, sizeof clock, "%H:%M:%S", &local);
  int n = std::snprintf(line, sizeof line, "[jitckpt %s%s pid %d] ", clock, rank_text(), static_cast<int>(getpid()));
  n += std::vsnprintf(line + n, sizeof line - n - 1, fmt, ap);
  if (n > static_cast<int>(sizeof line) - 2) n = sizeof line - 2;
  line[n++] = '\n';
  ssize_t ignored = write(STDERR_FILENO, line, n);
  (void)ignored;
}

}  // namespace

void log_always(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vlog(fmt, ap);
  va_end(ap);
}

void log_verbose(const char* fmt, ...) {
  if (!verbose_enabled()) return;
  va_list ap;
  va_start(ap, fmt);
  vlog(fmt, ap);
  va_end(ap);
}

}  // namespace jitckpt
