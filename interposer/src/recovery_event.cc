#include "recovery_event.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "diagnostics.h"
#include "environment.h"
#include "json_writer.h"

namespace jitckpt {
namespace {

// Starts a record with the fields every record of the launcher's log has.
void begin_record(JsonWriter& w, const char* event) {
  w.begin_object();
  w.key("t").value(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  w.key("event").value(event);
  w.key("gen").value(env_int("JITCKPT_EVENT_GEN", 0));
  w.key("rank").value(env_int("RANK", -1));
  w.key("pid").value(static_cast<int64_t>(getpid()));
}

// One line with one write on the O_APPEND log, as the launcher's own writers do.
void append_line(const char* path, const std::string& line) {
  const int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0 || write(fd, line.data(), line.size()) != static_cast<ssize_t>(line.size()))
    log_always("proxy mode: cannot append to the event log %s: %s", path, std::strerror(errno));
  if (fd >= 0) close(fd);
}

}  // namespace

void append_recovery_event(const RecoveryRecord& r) {
  const char* path = std::getenv("JITCKPT_EVENT_LOG");
  if (path == nullptr || *path == '\0') return;
  JsonWriter w;
  begin_record(w, "transparent_recovery");
  w.key("cause").value(r.cause);
  w.key("recovered").value(r.recovered);
  if (!r.recovered) w.key("reason").value(r.reason);
  w.key("calls").value(static_cast<uint64_t>(r.calls));
  w.key("minibatch_calls").value(static_cast<uint64_t>(r.minibatch_calls));
  w.key("undone").value(static_cast<uint64_t>(r.undone));
  w.key("bytes").value(static_cast<uint64_t>(r.bytes));
  w.key("save_s").value(r.save_s);
  w.key("new_proxy_s").value(r.new_proxy_s);
  w.key("recreate_s").value(r.recreate_s);
  w.key("communicators_s").value(r.communicators_s);
  w.key("agree_s").value(r.agree_s);
  w.key("restore_s").value(r.restore_s);
  w.key("replay_s").value(r.replay_s);
  w.key("synchronize_s").value(r.synchronize_s);
  w.key("total_s").value(r.total_s);
  w.end_object();
  append_line(path, w.str() + "\n");
}

void append_validation_event(const ValidationRecord& r) {
  const char* path = std::getenv("JITCKPT_EVENT_LOG");
  if (path == nullptr || *path == '\0') return;
  JsonWriter w;
  begin_record(w, "transparent_validation");
  w.key("minibatch").value(r.minibatch);
  w.key("matched").value(r.matched);
  if (!r.matched) w.key("detail").value(r.detail);
  w.key("calls").value(static_cast<uint64_t>(r.calls));
  w.key("bytes").value(r.bytes);
  w.key("seconds").value(r.seconds);
  w.end_object();
  append_line(path, w.str() + "\n");
}

void append_stage_caught_up(int64_t checkpoint, int64_t replayed) {
  const char* path = std::getenv("JITCKPT_EVENT_LOG");
  if (path == nullptr || *path == '\0') return;
  JsonWriter w;
  begin_record(w, "stage_caught_up");
  w.key("checkpoint").value(checkpoint);
  w.key("replayed").value(replayed < 0 ? int64_t{0} : replayed);
  w.end_object();
  append_line(path, w.str() + "\n");
}

}  // namespace jitckpt
