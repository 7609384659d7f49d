// A transparent recovery as a record of the job's event log (issue 16): `jitckpt run` gives its
// workers the log's path (JITCKPT_EVENT_LOG, <run_dir>/events.jsonl; schema in
// jitckpt/observability/events.py) and the generation (JITCKPT_EVENT_GEN), and `jitckpt report`
// shows the records. Without the path (no launcher) nothing is written; stderr has the same facts.
#pragma once

#include <cstddef>
#include <string>

namespace jitckpt {

struct RecoveryRecord {
  std::string cause;   // what was lost: the proxy's death, a sticky error
  bool recovered = false;
  std::string reason;  // why not, when not recovered
  size_t calls = 0;    // journal entries replayed
  size_t bytes = 0;
  // The breakdown (JIT paper Table 7's phases that apply): start a new proxy; replay the calls,
  // which recreates handles, communicators and buffers; synchronize the replayed work.
  double new_proxy_s = 0, replay_s = 0, synchronize_s = 0, total_s = 0;
};

// Appends `r` as one line with one write on the O_APPEND log, as the launcher's own writers do.
void append_recovery_event(const RecoveryRecord& r);

}  // namespace jitckpt
