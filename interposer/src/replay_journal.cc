#include "replay_journal.h"

#include <unistd.h>

#include <cstring>

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
uint32_t ReplayJournal::comm_init_rank_tag() {
  return proxy::kGenericBase + static_cast<uint32_t>(proxy::FunctionId::k_ncclCommInitRank);
}

namespace {

// What a call is, from its tag and name (the generated FunctionIds carry the header's names).
bool creates_by_name(uint32_t tag) {
  using proxy::Call;
  switch (static_cast<Call>(tag)) {
    case Call::kMalloc:
    case Call::kRegisterKernel:
    case Call::kRegisterModule:
    case Call::kHostAlloc:
      return true;
    default:
      break;
  }
  if (tag < proxy::kGenericBase) return false;
  const char* name = proxy::call_name(tag);
  return name != nullptr && (std::strstr(name, "Create") != nullptr || std::strstr(name, "ncclCommInit") != nullptr ||
                             std::strstr(name, "ncclCommSplit") != nullptr || std::strstr(name, "Malloc") != nullptr ||
                             std::strstr(name, "ncclMemAlloc") != nullptr);
}

bool ordered_by_name(uint32_t tag) {
  if (tag == static_cast<uint32_t>(proxy::Call::kFree) || tag == static_cast<uint32_t>(proxy::Call::kHostFree)) return true;
  const char* name = proxy::call_name(tag);
  if (name == nullptr || std::strncmp(name, "nccl", 4) == 0) return false;
  return creates_by_name(tag) || std::strncmp(name, "cudaFree", 8) == 0;
}

bool stateless_by_name(uint32_t tag) {
  using proxy::Call;
  switch (static_cast<Call>(tag)) {
    case Call::kMemcpyFromDevice:
    case Call::kMemcpyFromDeviceAsync:
      return true;
    default:
      break;
  }
  if (tag < proxy::kGenericBase || tag == ReplayJournal::unique_id_tag()) return false;
  const char* name = proxy::call_name(tag);
  return name != nullptr && (std::strstr(name, "Query") != nullptr || std::strstr(name, "Get") != nullptr ||
                             std::strstr(name, "Synchronize") != nullptr || std::strstr(name, "ElapsedTime") != nullptr);
}

enum Kind : uint8_t { kCreates = 1, kOrdered = 2, kStateless = 4 };
constexpr uint32_t kSpecialTags = 32;  // proxy::Call values are below this

uint8_t kinds_by_name(uint32_t tag) {
  return (creates_by_name(tag) ? kCreates : 0) | (ordered_by_name(tag) ? kOrdered : 0) |
         (stateless_by_name(tag) ? kStateless : 0);
}

// Every call's kinds, worked out once: they are asked for on every call.
uint8_t kinds(uint32_t tag) {
  static const std::vector<uint8_t> table = [] {
    std::vector<uint8_t> t(kSpecialTags + proxy::kFunctionCount);
    for (uint32_t i = 0; i < t.size(); ++i)
      t[i] = kinds_by_name(i < kSpecialTags ? i : proxy::kGenericBase + (i - kSpecialTags));
    return t;
  }();
  const uint32_t i = tag < kSpecialTags ? tag : tag >= proxy::kGenericBase ? kSpecialTags + (tag - proxy::kGenericBase)
                                                                            : UINT32_MAX;
  return i < table.size() ? table[i] : kinds_by_name(tag);
}

}  // namespace

bool ReplayJournal::creates(uint32_t tag) { return (kinds(tag) & kCreates) != 0; }
bool ReplayJournal::ordered(uint32_t tag) { return (kinds(tag) & kOrdered) != 0; }
bool ReplayJournal::stateless(uint32_t tag) { return (kinds(tag) & kStateless) != 0; }

int64_t ReplayJournal::append(uint32_t tag, uint32_t channel, bool no_reply, const uint8_t* payload, size_t size,
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
  e.tag = tag;
  e.channel = channel;
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
  if (tag == comm_init_rank_tag() &&
      size >= sizeof(proxy::RequestHead) + 1 + sizeof(int32_t)) {
    int32_t nranks = 0;
    std::memcpy(&nranks, payload + sizeof(proxy::RequestHead) + 1, sizeof nranks);
    if (nranks > 1) ++multi_rank_comms_;
  }
  entries_.push_back(std::move(e));
  return static_cast<int64_t>(entries_.size() - 1);
}

void ReplayJournal::completed(int64_t index, const proxy::CallResult& r) {
  std::lock_guard<std::mutex> lock(mu_);
  if (index < 0 || static_cast<size_t>(index) >= entries_.size()) return;  // dropped meanwhile
  Entry& e = entries_[static_cast<size_t>(index)];
  e.completed = true;
  e.status = r.status;
  if (creates(e.tag) || e.tag == unique_id_tag()) e.results = r.results;
}

bool ReplayJournal::on() const {
  std::lock_guard<std::mutex> lock(mu_);
  return off_.empty();
}

std::string ReplayJournal::off_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return off_;
}

std::string ReplayJournal::cannot_replay_alone() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (multi_rank_comms_ == 0) return "";
  return "this process has an NCCL communicator with peers in other processes; rebuilding it together with "
         "them is not built yet";
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
