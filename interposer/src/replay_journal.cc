#include "replay_journal.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>

#include "call_kinds.h"
#include "call_protocol.h"
#include "diagnostics.h"
#include "proxy_functions.h"

namespace jitckpt {

ReplayJournal::ReplayJournal(size_t limit_bytes) : limit_(limit_bytes) {
  if (limit_ == 0) off_ = "JITCKPT_REPLAY_LIMIT_MB=0";
}

ReplayJournal::~ReplayJournal() {
  for (const Entry& e : entries_)
    if (e.fd >= 0) close(e.fd);
}

uint32_t ReplayJournal::unique_id_tag() {
  return proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclGetUniqueId);
}
bool ReplayJournal::inits_comm_from_id(uint32_t tag) {
  return tag == proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclCommInitRank) ||
         tag == proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclCommInitRankConfig);
}

namespace {

// What a call is: a hand-written call's kinds here, by its tag; a generated call's from the table
// the generator worked out (proxy::function_kinds, forwarding.py's call_kinds).
uint8_t generated_kinds(uint32_t tag) {
  return tag >= proxy::kGenericBase ? proxy::function_kinds(tag - proxy::kGenericBase) : 0;
}

bool creates_call(uint32_t tag) {
  using proxy::Call;
  switch (static_cast<Call>(tag)) {
    case Call::kMalloc:
    case Call::kRegisterKernel:
    case Call::kRegisterModule:
    case Call::kHostAlloc:
      return true;
    default:
      return (generated_kinds(tag) & proxy::kCallCreates) != 0;
  }
}

bool ordered_call(uint32_t tag) {
  using proxy::Call;
  if (tag == static_cast<uint32_t>(Call::kFree) || tag == static_cast<uint32_t>(Call::kHostFree)) return true;
  return tag < proxy::kGenericBase ? creates_call(tag) : (generated_kinds(tag) & proxy::kCallOrdered) != 0;
}

bool stateless_call(uint32_t tag) {
  using proxy::Call;
  switch (static_cast<Call>(tag)) {
    case Call::kMemcpyFromDevice:
    case Call::kMemcpyFromDeviceAsync:
      return true;
    default:
      return (generated_kinds(tag) & proxy::kCallStateless) != 0;
  }
}

bool work_call(uint32_t tag) {
  using proxy::Call;
  switch (static_cast<Call>(tag)) {
    case Call::kLaunchKernel:
    case Call::kMemcpyToDevice:
    case Call::kMemcpy:
    case Call::kMemcpyAsync:
    case Call::kMemcpyToDeviceAsync:
    case Call::kMemset:
      return true;
    default:
      return (generated_kinds(tag) & proxy::kCallWork) != 0;
  }
}

enum Kind : uint8_t { kCreates = 1, kOrdered = 2, kStateless = 4, kWork = 8 };
constexpr uint32_t kSpecialTags = 32;  // proxy::Call values are below this

uint8_t kinds_of_call(uint32_t tag) {
  return (creates_call(tag) ? kCreates : 0) | (ordered_call(tag) ? kOrdered : 0) |
         (stateless_call(tag) ? kStateless : 0) | (work_call(tag) ? kWork : 0);
}

// Every call's kinds, worked out once: they are asked for on every call. A trivially destructible
// array: the watchdog thread still makes calls while exit() runs static destructors.
uint8_t kinds(uint32_t tag) {
  static const std::array<uint8_t, kSpecialTags + proxy::kFunctionCount> table = [] {
    std::array<uint8_t, kSpecialTags + proxy::kFunctionCount> t{};
    for (uint32_t i = 0; i < t.size(); ++i)
      t[i] = kinds_of_call(i < kSpecialTags ? i : proxy::kGenericBase + (i - kSpecialTags));
    return t;
  }();
  const uint32_t i = tag < kSpecialTags ? tag : tag >= proxy::kGenericBase ? kSpecialTags + (tag - proxy::kGenericBase)
                                                                            : UINT32_MAX;
  return i < table.size() ? table[i] : kinds_of_call(tag);
}

}  // namespace

bool ReplayJournal::creates(uint32_t tag) { return (kinds(tag) & kCreates) != 0; }
bool ReplayJournal::ordered(uint32_t tag) { return (kinds(tag) & kOrdered) != 0; }
bool ReplayJournal::stateless(uint32_t tag) { return (kinds(tag) & kStateless) != 0; }
bool ReplayJournal::work(uint32_t tag) { return (kinds(tag) & kWork) != 0; }

int64_t ReplayJournal::append(uint32_t tag, uint32_t channel, uint64_t seq, bool no_reply, const uint8_t* payload, size_t size,
                              int fd, uint64_t fd_token, const HostSource* source, const void* source_bytes,
                              size_t source_size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!off_.empty()) return -1;
  const size_t n = source ? source_size : size;
  if (bytes_.size() + n > limit_) {
    turn_off_locked("the replay journal reached its limit of " + std::to_string(limit_ >> 20) +
                    " MiB (JITCKPT_REPLAY_LIMIT_MB)");
    return -1;
  }
  Entry e;
  e.id = next_id_++;
  e.tag = tag;
  e.channel = channel;
  e.seq = seq;
  e.no_reply = no_reply;
  e.offset = bytes_.size();
  e.size = n;
  if (source) {
    e.has_source = true;
    e.source = *source;
    bytes_.insert(bytes_.end(), static_cast<const uint8_t*>(source_bytes),
                  static_cast<const uint8_t*>(source_bytes) + source_size);
  } else {
    bytes_.insert(bytes_.end(), payload, payload + size);
  }
  if (fd >= 0) {
    e.fd = dup(fd);
    if (e.fd < 0) {
      turn_off_locked(std::string("cannot keep a memfd for replay: ") + std::strerror(errno));
      return -1;
    }
    e.fd_token = fd_token;
  }
  // A communicator with peers in other processes: offset of nranks after the head and the
  // presence byte of the communicator result (see the generated fwd_ncclCommInitRank).
  if (inits_comm_from_id(tag) && size >= kCommRankOffset + sizeof(int32_t)) {
    int32_t nranks = 0;
    std::memcpy(&nranks, payload + sizeof(proxy::RequestHead) + 1, sizeof nranks);
    if (nranks > 1) {
      PeerComm c{std::string(reinterpret_cast<const char*>(payload) + kCommIdOffset, 128), 0, nranks};
      std::memcpy(&c.rank, payload + kCommRankOffset, sizeof c.rank);
      if (multi_rank_comms_[c.id]++ == 0) peer_comms_.push_back(std::move(c));
    }
  }
  entries_.push_back(std::move(e));
  return static_cast<int64_t>(entries_.back().id);
}

void ReplayJournal::completed(int64_t id, const proxy::CallResult& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (id < 0) return;
  auto it = std::lower_bound(entries_.begin(), entries_.end(), static_cast<uint64_t>(id),
                             [](const Entry& e, uint64_t v) { return e.id < v; });
  if (it == entries_.end() || it->id != static_cast<uint64_t>(id)) return;  // dropped meanwhile
  Entry& e = *it;
  e.completed = true;
  e.status = r.status;
  if (creates(e.tag) || e.tag == unique_id_tag()) e.results = r.results;
}

void ReplayJournal::mark_minibatch(std::vector<DeviceRange> live_allocations) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!off_.empty()) return;
  compact_locked();
  phase_ = Phase::kMinibatch;
  mark_id_ = next_id_;
  mark_allocations_ = std::move(live_allocations);
}

void ReplayJournal::mark_optimizer_step() {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ != Phase::kMinibatch) return;
  phase_ = Phase::kOptimizerStep;
  optimizer_id_ = next_id_;
}

ReplayJournal::Phase ReplayJournal::phase_of(int64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (phase_ != Phase::kOptimizerStep || id < 0) return phase_;
  return static_cast<uint64_t>(id) < optimizer_id_ ? Phase::kMinibatch : Phase::kOptimizerStep;
}

int64_t ReplayJournal::find(uint32_t channel, uint64_t seq, uint32_t tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it)
    if (it->channel == channel && it->seq == seq && it->tag == tag) return static_cast<int64_t>(it->id);
  return -1;
}

bool ReplayJournal::request(int64_t id, std::vector<uint8_t>* bytes, uint32_t* channel) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::lower_bound(entries_.begin(), entries_.end(), id,
                             [](const Entry& e, int64_t want) { return static_cast<int64_t>(e.id) < want; });
  if (id < 0 || it == entries_.end() || static_cast<int64_t>(it->id) != id || it->has_source) return false;
  bytes->assign(bytes_.data() + it->offset, bytes_.data() + it->offset + it->size);
  *channel = it->channel;
  return true;
}

int64_t ReplayJournal::find_any_channel(uint64_t seq, uint32_t tag) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it)
    if (it->seq == seq && it->tag == tag) return static_cast<int64_t>(it->id);
  return -1;
}

ReplayJournal::Phase ReplayJournal::phase() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_;
}

std::vector<ReplayJournal::DeviceRange> ReplayJournal::allocations_at_mark() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mark_allocations_;
}

// Keeps what built state (see the header) and drops device work, failed calls, and NCCL groups
// left empty; the kept entries' bytes move to a new store. The kept part is what the program
// created and set up, so it stays small while the program does not create something every step.
void ReplayJournal::compact_locked() {
  const uint32_t group_start = proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclGroupStart);
  const uint32_t group_end = proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclGroupEnd);
  std::vector<Entry> kept;
  std::vector<uint8_t> bytes;
  struct OpenGroup {
    size_t at;  // the ncclGroupStart's position in `kept`
    bool holds_kept = false;
  };
  std::map<uint32_t, std::vector<OpenGroup>> groups;  // per channel: groups are per thread
  auto keep = [&](Entry& e) {
    const size_t offset = bytes.size();
    bytes.insert(bytes.end(), bytes_.begin() + static_cast<std::ptrdiff_t>(e.offset),
                 bytes_.begin() + static_cast<std::ptrdiff_t>(e.offset + e.size));
    e.offset = offset;
    kept.push_back(std::move(e));
    e.fd = -1;
  };
  auto drop = [](Entry& e) {
    if (e.fd >= 0) close(e.fd);
    e.fd = -1;
  };
  for (Entry& e : entries_) {
    std::vector<OpenGroup>& open = groups[e.channel];
    if (e.tag == group_start) {
      open.push_back(OpenGroup{kept.size()});
      keep(e);
    } else if (e.tag == group_end && !open.empty()) {
      const OpenGroup g = open.back();
      open.pop_back();
      if (g.holds_kept) {
        keep(e);
        if (!open.empty()) open.back().holds_kept = true;
      } else {  // only the start is left of this group
        bytes.resize(kept[g.at].offset);
        kept.resize(g.at);
        drop(e);
      }
    } else if ((e.completed && e.status != 0) || (work(e.tag) && e.completed) || (work(e.tag) && e.no_reply)) {
      drop(e);
    } else {
      keep(e);
      if (!open.empty()) open.back().holds_kept = true;
    }
  }
  entries_ = std::move(kept);
  bytes_ = std::move(bytes);
}

bool ReplayJournal::on() const {
  std::lock_guard<std::mutex> lock(mu_);
  return off_.empty();
}

std::string ReplayJournal::off_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return off_;
}

std::string ReplayJournal::cannot_replay(bool peers_reachable) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (multi_rank_comms_.empty()) return "";
  if (!peers_reachable)
    return "this process has an NCCL communicator with peers in other processes, and no way to rebuild it with them "
           "(the launcher's store: run the job with `jitckpt run --transparent`)";
  for (const auto& [id, ranks] : multi_rank_comms_)
    if (ranks > 1)
      return "this process holds " + std::to_string(ranks) + " ranks of one NCCL communicator (on several threads): "
             "its replay, on one thread, cannot rebuild them together";
  return "";
}

std::vector<ReplayJournal::PeerComm> ReplayJournal::peer_comms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peer_comms_;
}

bool ReplayJournal::has_peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !multi_rank_comms_.empty();
}

void ReplayJournal::turn_off(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (off_.empty()) turn_off_locked(why);
}

void ReplayJournal::turn_off_locked(const std::string& why) {
  off_ = why;
  for (Entry& e : entries_)
    if (e.fd >= 0) close(e.fd);
  entries_.clear();
  entries_.shrink_to_fit();
  bytes_.clear();
  bytes_.shrink_to_fit();
  log_always("proxy mode: transparent recovery is off for this process: %s; a lost proxy now fails the process",
             why.c_str());
}

}  // namespace jitckpt
