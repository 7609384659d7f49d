#include "recovery_event.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "diagnostics.h"
#include "json_writer.h"

namespace jitckpt {
namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  return *end == '\0' ? n : fallback;
}

}  // namespace

void append_recovery_event(const RecoveryRecord& r) {
  const char* path = std::getenv("JITCKPT_EVENT_LOG");
  if (path == nullptr || *path == '\0') return;
  JsonWriter w;
  w.begin_object();
  w.key("t").value(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  w.key("event").value("transparent_recovery");
  w.key("gen").value(env_int("JITCKPT_EVENT_GEN", 0));
  w.key("rank").value(env_int("RANK", -1));
  w.key("pid").value(static_cast<int64_t>(getpid()));
  w.key("cause").value(r.cause);
  w.key("recovered").value(r.recovered);
  if (!r.recovered) w.key("reason").value(r.reason);
  w.key("calls").value(static_cast<uint64_t>(r.calls));
  w.key("minibatch_calls").value(static_cast<uint64_t>(r.minibatch_calls));
  w.key("bytes").value(static_cast<uint64_t>(r.bytes));
  w.key("save_s").value(r.save_s);
  w.key("new_proxy_s").value(r.new_proxy_s);
  w.key("recreate_s").value(r.recreate_s);
  w.key("restore_s").value(r.restore_s);
  w.key("replay_s").value(r.replay_s);
  w.key("synchronize_s").value(r.synchronize_s);
  w.key("total_s").value(r.total_s);
  w.end_object();
  const std::string line = w.str() + "\n";
  const int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    log_always("proxy mode: cannot append the recovery to the event log %s: %s", path, std::strerror(errno));
  if (fd >= 0) close(fd);
}

}  // namespace jitckpt
