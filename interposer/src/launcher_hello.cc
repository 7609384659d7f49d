// Registers a `jitckpt run --no-python` worker with its launcher: one Hello on the control channel
// (JITCKPT_CONTROL_FD, a socketpair) saying that the process cannot save. libjit.so has no JIT
// save of its own (the failure callback is only ever set by jitckpt's Python runtime), so without
// this the launcher would wait --save-timeout for a checkpoint that never comes after a failure
// (issue 43). The message is jitckpt/protocol/control_messages.py's Hello; its decoder refuses
// unknown fields, so the two are changed together.
//
// Only where the launcher asks (JITCKPT_NATIVE_HELLO=1, set for --no-python workers): a standby or
// worker of a Python job has the same channel in its environment, and its runtime registers itself.
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "diagnostics.h"
#include "environment.h"
#include "json_writer.h"

namespace jitckpt {
namespace {

constexpr const char* kAskedVar = "JITCKPT_NATIVE_HELLO";
constexpr const char* kChannelVar = "JITCKPT_CONTROL_FD";

// {"type": "hello", "rank": R, "pid": P, "gen": G, "can_save": false} and a newline.
std::string hello_line() {
  JsonWriter w;
  w.begin_object();
  w.key("type").value("hello");
  w.key("rank").value(env_int("RANK", -1));
  w.key("pid").value(static_cast<int64_t>(getpid()));
  w.key("gen").value(env_int("JITCKPT_GEN", 0));
  w.key("can_save").value(false);
  w.end_object();
  return w.str() + "\n";
}

// The whole of `line` on the stream socket `fd`. MSG_NOSIGNAL: a launcher already gone must not
// kill the program with SIGPIPE.
bool send_all(int fd, const std::string& line) {
  size_t sent = 0;
  while (sent < line.size()) {
    const ssize_t n = send(fd, line.data() + sent, line.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    sent += static_cast<size_t>(n);
  }
  return true;
}

void register_with_launcher() {
  const char* asked = std::getenv(kAskedVar);
  if (asked == nullptr || std::strcmp(asked, "1") != 0) return;
  // Once per worker: processes this one starts (its device proxy, a program it execs from a
  // wrapper) are not the rank and must not register again in its name.
  unsetenv(kAskedVar);
  const int64_t fd = env_int(kChannelVar, -1);
  if (fd < 0) return;
  // The fd stays open: the launcher takes its end-of-file for the worker's exit.
  if (!send_all(static_cast<int>(fd), hello_line()))
    log_always("cannot tell the launcher on %s=%lld that this program has no save path: %s", kChannelVar,
               static_cast<long long>(fd), std::strerror(errno));
}

}  // namespace
}  // namespace jitckpt

// At load, before the program's first CUDA call: a peer may fail before this rank makes one.
__attribute__((constructor)) static void jitckpt_launcher_hello() { jitckpt::register_with_launcher(); }
