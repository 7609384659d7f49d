// A transparent recovery, or a replay validation, as a record of the job's event log (issue 16): `jitckpt run` gives its
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
  size_t minibatch_calls = 0;  // of them, the current minibatch's (all of them without marks)
  size_t bytes = 0;
  size_t undone = 0;   // optimizer-step launches undone by the undo plugin before the replay
  // The breakdown (JIT paper Table 7's phases that apply): copy the buffers live at the minibatch's
  // start out of the old proxy (with minibatch marks); start a new proxy; recreate what the program
  // built (allocations, handles, communicators: the journal's calls before the minibatch); put the
  // buffers back; replay the minibatch's calls (without marks: every call); synchronize.
  double save_s = 0, new_proxy_s = 0, recreate_s = 0, restore_s = 0, replay_s = 0, synchronize_s = 0, total_s = 0;
  double communicators_s = 0;  // part of recreate_s (or replay_s unmarked): communicators' inits, peers waited for
  double agree_s = 0;          // waiting for the peers' word that they recover too (before the new proxy)
};

// A replay validation (JIT paper §4.1): the minibatch's calls replayed into a scratch proxy on top of
// the buffers of its start, compared with the live proxy's buffers before the optimizer step.
struct ValidationRecord {
  uint64_t minibatch = 0;  // minibatch marks so far (1: the first minibatch)
  bool matched = false;
  std::string detail;  // the first difference, or why the validation could not run
  size_t calls = 0;    // replayed
  uint64_t bytes = 0;  // of device buffers compared
  double seconds = 0;  // the pause it cost the application
};

// Appends `r` as one line with one write on the O_APPEND log, as the launcher's own writers do.
void append_recovery_event(const RecoveryRecord& r);
void append_validation_event(const ValidationRecord& r);
// A replacement stage replayed its receives from the logs and now runs live (recv_replay.h): the
// launcher's StageCaughtUp, for programs that have no control channel. `checkpoint`: the iteration
// of the global checkpoint it started from; `replayed`: the iterations it replayed.
void append_stage_caught_up(int64_t checkpoint, int64_t replayed);

}  // namespace jitckpt
