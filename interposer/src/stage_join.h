// A replacement pipeline stage joins its survivors' communicator in proxy mode (issue 16,
// `--plugin logging`, SWIFT's logging-based recovery for native programs). The survivors do not
// roll back: their hung send or receive to the dead stage is a transparent recovery in which they
// replay only their current minibatch; the replacement starts over from the global checkpoint,
// serves its receives from the neighbours' send logs through the iteration before the survivors'
// (recv_replay.h), and runs that one live with them.
//
// Through the launcher's store (rendezvous_store.h):
//   jitckpt/transparent/new/<nranks>/<rank> = <nonce>   the newcomer, at its first communicator init
//   jitckpt/transparent/join/<nonce> = <id hex>/<rebuilds>/<through>   the survivors' terms
// A survivor's vote takes a nonce it has not seen for a rank whose word is missing as that rank's
// "new" word (rebuild_vote.h). The terms name the survivors' communicator as their journals recorded
// it (its first unique id, and how often it was rebuilt), so the newcomer agrees on the new unique id
// with them, and later recoveries name the communicator alike on every rank.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>

#include "rendezvous_store.h"

namespace jitckpt {

class StageJoin {
 public:
  StageJoin();  // JITCKPT_STAGE_JOIN=1: this process is a replacement; JITCKPT_SEND_LOG_DIR: logging is on

  struct Terms {
    std::string id;         // the communicator's unique id as the survivors' journals recorded it
    uint64_t rebuilds = 0;  // how often they rebuilt it before
    int64_t through = -1;   // the last iteration to replay from the logs
    std::string encode() const;
    static bool decode(const std::string& text, Terms* out);
  };

  // This process replaces a dead stage and has not joined yet.
  bool pending() const;
  // This process is a replacement that joined (or tried to).
  bool joined() const;
  // Survivors wait for a dead peer's replacement (their send log is on).
  bool logging() const { return logging_; }
  // The newcomer: says it is here as rank `rank` of a communicator of `nranks` and waits (up to
  // `wait`) for the survivors' terms. Once per process: later communicators are made as usual.
  bool join(const RendezvousStore& store, int nranks, int rank, std::chrono::milliseconds wait, Terms* terms,
            std::string* why);
  // A survivor: whether a replacement of rank `rank` announced itself and waits (not taken yet).
  bool announced(const RendezvousStore& store, int nranks, int rank) const;
  // A survivor: whether a replacement of rank `rank` announced itself since the last one this
  // process took (its nonce, marked taken).
  bool arrived(const RendezvousStore& store, int nranks, int rank, std::string* nonce);
  // A survivor: the terms for the newcomer with `nonce`.
  static bool offer(const RendezvousStore& store, const std::string& nonce, const Terms& terms, std::string* why);

 private:
  static std::string new_key(int nranks, int rank);

  const bool logging_;
  mutable std::mutex mu_;
  bool pending_;
  bool joined_ = false;
  std::set<std::string> taken_;  // newcomers' nonces already joined (by this process, or before it joined)
};

}  // namespace jitckpt
