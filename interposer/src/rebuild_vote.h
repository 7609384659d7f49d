// The rule of a transparent recovery's vote among a communicator's ranks (issue 16): each rank
// says its word through the launcher's store, every rank applies this rule to the same words, so
// all decide alike without a coordinator. ProxySession::agree_to_rebuild says and reads the words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jitckpt {

// A rank's word: "yes/<minibatch>[/optimizer][/undo][/it<iteration>]" (it has its buffers of the
// minibatch's start, or partly updated ones its undo plugin undoes), "replica/<minibatch>[/optimizer]"
// (it lost them), "no: <why>", or "new": a replacement of a dead pipeline stage that starts over
// from the global checkpoint and replays from its neighbours' send logs (--plugin logging; the
// survivors say it for it, see stage_join.h). "/optimizer": its host had begun that minibatch's
// optimizer step. "/it<i>": the iteration its send log was at (set_log_context), with logging on.
struct VoteWord {
  enum Kind { kNo, kYes, kReplica, kNew } kind = kNo;
  uint64_t minibatch = 0;
  bool optimizer_step = false;
  bool undo = false;  // a yes word's: undone only in its own replay, so no donor
  int64_t iteration = -1;  // the log context's, or -1
  std::string text;

  static VoteWord parse(const std::string& text);
  // A "no" word's refusal, as every rank says it: "rank R of a communicator of N cannot recover ...".
  std::string refusal(int rank, int nranks) const;
};

// Where each rank's collectives go on after the recovery. The ranks with their buffers replay
// their minibatch; a rank that lost them takes the donor's (the lowest rank with its own buffers,
// not undoing, of the newest minibatch) of that minibatch's start. A rank one minibatch behind the
// donor and in its optimizer step takes them too and skips the rest of its step (JIT paper case
// 4): the donor got past that minibatch's collectives, so they were complete on every rank, and the
// step (a lost proxy's, or one still running behind a collective merely not yet seen complete) is
// the donor's. Anything else would leave a rank a collective out of step with the others: refused.
//
// With newcomers (SWIFT logging): every other rank replays its own minibatch, which must be the
// same iteration on all of them; the newcomers replay their receives through the one before it from
// the logs (`through`) and run that iteration live with them. No buffers change hands (a newcomer
// has only the global checkpoint's), and the survivors' minibatch counts are not compared: a
// newcomer of an earlier recovery counts its minibatches from its checkpoint.
struct RebuildPlan {
  int donor = -1;
  std::vector<int> receivers;  // ranks that take the donor's buffers
  std::vector<bool> skip;      // per rank: it skips the rest of its minibatch
  std::vector<int> newcomers;  // ranks that join from the logs
  int64_t through = -1;        // with newcomers: the last iteration they replay from the logs
  std::string refusal;         // "" when the communicator can rebuild

  bool receives(int rank) const;
};

// `comms`: how many communicators with peers in other processes this rank has (a replica is taken
// only within the one, its data-parallel group).
RebuildPlan plan_rebuild(const std::vector<VoteWord>& words, size_t comms);

}  // namespace jitckpt
