// stderr diagnostics of libjit.so. JITCKPT_VERBOSE=1 enables the verbose ones.
#pragma once

namespace jitckpt {

void log_always(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void log_verbose(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace jitckpt
