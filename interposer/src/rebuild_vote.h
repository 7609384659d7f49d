// The rule of a transparent recovery's vote among a communicator's ranks (issue 16): each rank
// says its word through the launcher's store, every rank applies this rule to the same words, so
// all decide alike without a coordinator. ProxySession::agree_to_rebuild says and reads the words.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace jitckpt {

// A rank's word: "yes/<minibatch>[/optimizer][/undo]" (it has its buffers of the minibatch's
// start, or partly updated ones its undo plugin undoes), "replica/<minibatch>[/optimizer]" (it lost
// them), or "no: <why>". "/optimizer": its host had begun that minibatch's optimizer step.
struct VoteWord {
  enum Kind { kNo, kYes, kReplica } kind = kNo;
  uint64_t minibatch = 0;
  bool optimizer_step = false;
  bool undo = false;  // a yes word's: undone only in its own replay, so no donor
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
struct RebuildPlan {
  int donor = -1;
  std::vector<int> receivers;  // ranks that take the donor's buffers
  std::vector<bool> skip;      // per rank: it skips the rest of its minibatch
  std::string refusal;         // "" when the communicator can rebuild

  bool receives(int rank) const;
};

// `comms`: how many communicators with peers in other processes this rank has (a replica is taken
// only within the one, its data-parallel group).
RebuildPlan plan_rebuild(const std::vector<VoteWord>& words, size_t comms);

}  // namespace jitckpt
