#include "rebuild_vote.h"

#include <algorithm>
#include <cstdlib>

namespace jitckpt {

VoteWord VoteWord::parse(const std::string& text) {
  VoteWord w;
  w.text = text;
  if (text == "new") {
    w.kind = kNew;
    return w;
  }
  const bool yes = text.rfind("yes/", 0) == 0, replica = text.rfind("replica/", 0) == 0;
  if (!yes && !replica) return w;
  w.kind = yes ? kYes : kReplica;
  char* end = nullptr;
  w.minibatch = std::strtoull(text.c_str() + (yes ? 4 : 8), &end, 10);
  const std::string rest = end != nullptr ? end : "";
  w.undo = yes && rest.find("/undo") != std::string::npos;
  w.optimizer_step = w.undo || rest.find("/optimizer") != std::string::npos;
  if (const size_t at = rest.find("/it"); at != std::string::npos) w.iteration = std::strtoll(rest.c_str() + at + 3, nullptr, 10);
  return w;
}

std::string VoteWord::refusal(int rank, int nranks) const {
  return "rank " + std::to_string(rank) + " of a communicator of " + std::to_string(nranks) +
         " cannot recover transparently: " + text.substr(text.rfind("no: ", 0) == 0 ? 4 : 0);
}

bool RebuildPlan::receives(int rank) const {
  return std::find(receivers.begin(), receivers.end(), rank) != receivers.end();
}

namespace {

// Survivors and newcomers: see RebuildPlan.
RebuildPlan plan_join(const std::vector<VoteWord>& words) {
  RebuildPlan plan;
  const int n = static_cast<int>(words.size());
  plan.skip.assign(words.size(), false);
  const std::string of = " of a communicator of " + std::to_string(n);
  int64_t iteration = -1;
  int first = -1;
  for (int r = 0; r < n && plan.refusal.empty(); ++r) {
    const VoteWord& w = words[static_cast<size_t>(r)];
    const std::string who = "rank " + std::to_string(r) + of;
    if (w.kind == VoteWord::kNew) {
      plan.newcomers.push_back(r);
    } else if (w.kind == VoteWord::kNo) {
      plan.refusal = w.refusal(r, n);
    } else if (w.kind == VoteWord::kReplica) {
      plan.refusal = who + " lost its buffers while a dead stage is replaced from the logs: a replica's buffers and a "
                     "replacement stage in one recovery are not supported";
    } else if (w.iteration < 0) {
      plan.refusal = who + " has no send-log iteration (the program sets none with set_log_context): a replacement "
                     "stage cannot tell which messages to replay";
    } else if (first < 0) {
      first = r, iteration = w.iteration;
    } else if (w.iteration != iteration) {
      plan.refusal = who + " is at iteration " + std::to_string(w.iteration) + " and rank " + std::to_string(first) +
                     " at " + std::to_string(iteration) + ": the replacement stage can join only one";
    }
  }
  if (plan.refusal.empty() && first < 0) plan.refusal = "every rank" + of + " is new: nobody kept the state";
  plan.through = iteration - 1;
  return plan;
}

}  // namespace

RebuildPlan plan_rebuild(const std::vector<VoteWord>& words, size_t comms) {
  if (std::any_of(words.begin(), words.end(), [](const VoteWord& w) { return w.kind == VoteWord::kNew; }))
    return plan_join(words);
  RebuildPlan plan;
  const int n = static_cast<int>(words.size());
  plan.skip.assign(words.size(), false);
  uint64_t newest = 0;
  bool any_yes = false;
  for (const VoteWord& w : words)
    if (w.kind == VoteWord::kYes) newest = std::max(newest, w.minibatch), any_yes = true;
  for (int r = 0; r < n && plan.donor < 0; ++r) {
    const VoteWord& w = words[static_cast<size_t>(r)];
    if (w.kind == VoteWord::kYes && !w.undo && w.minibatch == newest) plan.donor = r;
  }
  const std::string of = " of a communicator of " + std::to_string(n);
  for (int r = 0; r < n && plan.refusal.empty(); ++r) {
    const VoteWord& w = words[static_cast<size_t>(r)];
    if (w.kind == VoteWord::kNo) {
      plan.refusal = w.refusal(r, n);
      continue;
    }
    if (w.kind == VoteWord::kYes && w.minibatch == newest) continue;  // replays its own minibatch
    const bool behind = any_yes && w.minibatch + 1 == newest && w.optimizer_step;
    const bool same = w.kind == VoteWord::kReplica && (!any_yes || w.minibatch == newest);
    const std::string who = "rank " + std::to_string(r) + of;
    if (!same && !behind) {
      plan.refusal = who + " is at minibatch " + std::to_string(w.minibatch) +
                     (w.optimizer_step ? " (in its optimizer step)" : "") + " and another at " + std::to_string(newest) +
                     ": replaying would leave their collectives out of step";
    } else if (comms != 1) {
      plan.refusal = who + " needs a replica's buffers, and this rank has several communicators with peers";
    } else if (plan.donor < 0) {
      plan.refusal = "every rank" + of + " lost its buffers or is partly through its optimizer step (--plugin undo "
                     "undoes that in its own replay only): no replica";
    } else {
      plan.receivers.push_back(r);
      plan.skip[static_cast<size_t>(r)] = behind;
    }
  }
  return plan;
}

}  // namespace jitckpt
