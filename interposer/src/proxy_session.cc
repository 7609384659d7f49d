#include "proxy_session.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <dlfcn.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "call_protocol.h"
#include "device_fault.h"
#include "diagnostics.h"
#include "journal_replay.h"
#include "json_writer.h"
#include "proxy_failure.h"
#include "proxy_forwarding.h"
#include "proxy_functions.h"
#include "registry.h"
#include "rebuild_vote.h"
#include "watchdog.h"

extern char** environ;

namespace jitckpt {
namespace {

// A call waits as long as the direct call would: for as long as the proxy lives (its death is
// noticed within one 20 ms slice). A synchronize behind a long step is not a failure.
constexpr auto kWhileTheProxyLives = std::chrono::hours(24 * 365);

bool mode_is_proxy() {
  const char* m = std::getenv("JITCKPT_MODE");
  return m != nullptr && std::strcmp(m, "proxy") == 0;
}

// JITCKPT_PROXY_BINARY, else next to libjit.so: <lib>/../bin (build tree) or <lib> (wheel).
std::string proxy_binary() {
  if (const char* env = std::getenv("JITCKPT_PROXY_BINARY"); env && *env) return env;
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&proxy_binary), &info) && info.dli_fname) {
    std::string dir(info.dli_fname);
    dir = dir.substr(0, dir.rfind('/') + 1);
    for (const char* rel : {"../bin/jitckpt-proxy", "jitckpt-proxy"}) {
      std::string p = dir + rel;
      if (access(p.c_str(), X_OK) == 0) return p;
    }
    return dir + "../bin/jitckpt-proxy";
  }
  return "jitckpt-proxy";
}

// The application's environment without what would make the proxy a client of itself.
// A scratch proxy (replay validation) gets no simcuda failure injection: a fault meant for the
// application's proxy must not fire, or use up its SIMCUDA_FAIL_ONCE marker, in the scratch one.
std::vector<std::string> proxy_environment(bool scratch = false) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv(*e);
    if (kv.rfind("JITCKPT_MODE=", 0) == 0) continue;
    if (scratch && kv.rfind("SIMCUDA_FAIL_", 0) == 0) continue;
    if (kv.rfind("LD_PRELOAD=", 0) == 0) {
      std::string kept, item, list = kv.substr(11);
      size_t at = 0;
      while (at <= list.size()) {
        size_t end = list.find_first_of(": ", at);
        if (end == std::string::npos) end = list.size();
        item = list.substr(at, end - at);
        if (!item.empty() && item.find("libjit") == std::string::npos) kept += (kept.empty() ? "" : ":") + item;
        at = end + 1;
      }
      if (!kept.empty()) env.push_back("LD_PRELOAD=" + kept);
      continue;
    }
    env.push_back(kv);
  }
  return env;
}

// Counts a thread in ProxySession::recovering_ from a failure found to the end of its recovery.
class RecoveringScope {
 public:
  explicit RecoveringScope(std::atomic<int>& n) : n_(n) { n_.fetch_add(1); }
  ~RecoveringScope() { n_.fetch_sub(1); }
  RecoveringScope(const RecoveringScope&) = delete;
  RecoveringScope& operator=(const RecoveringScope&) = delete;

 private:
  std::atomic<int>& n_;
};

}  // namespace

bool ProxySession::start_locked(std::string* why) {
  if (client_) return true;
  if (!start_failure_.empty()) {
    *why = start_failure_;
    return false;
  }
  try {
    const std::vector<std::string> env = proxy_environment();
    client_ = proxy::ProxyClient::start(proxy_binary(), std::chrono::seconds(30), &env);
    channels_.attach(client_.get());
    log_verbose("proxy mode: jitckpt-proxy pid %d serves this process", static_cast<int>(client_->pid()));
    Registry::instance().watchdog().ensure_started();  // it finds a proxy that stops answering
    return true;
  } catch (const std::exception& e) {
    start_failure_ = e.what();
    log_always("proxy mode: %s (set JITCKPT_PROXY_BINARY, or JITCKPT_MODE=observe)", e.what());
    *why = start_failure_;
    return false;
  }
}

namespace {

// This thread's channel, the proxy generation it belongs to, and its index (which survives a
// replacement of the proxy: the thread gets the new proxy's channel of the same index).
thread_local proxy::ProxyChannel* t_channel = nullptr;
thread_local uint64_t t_generation = 0;
thread_local uint32_t t_index = 0;
thread_local int64_t t_last_journal_id = -1;

// Closes the channel of a thread other than the main one when it exits, so threads that come and go
// leave no rings and no idle proxy thread behind. The main thread's stays open: static destructors
// still make calls on it after its thread-local objects are gone.
struct ChannelCloser {
  bool armed = false;
  ~ChannelCloser() {
    if (armed && t_channel != nullptr && Registry::instance().tracking())  // not in a forked child
      Registry::instance().proxy().close_channel(t_index);
    t_channel = nullptr;
  }
};
thread_local ChannelCloser t_closer;

size_t replay_limit() {
  const char* env = std::getenv("JITCKPT_REPLAY_LIMIT_MB");
  if (env == nullptr || *env == '\0') return size_t{1024} << 20;
  char* end = nullptr;
  const unsigned long long mb = std::strtoull(env, &end, 10);
  if (*end != '\0' || mb > (size_t{1} << 24)) {
    log_always("ignoring JITCKPT_REPLAY_LIMIT_MB=%s: expected a number of MiB (0 turns the replay journal off)", env);
    return size_t{1024} << 20;
  }
  return static_cast<size_t>(mb) << 20;
}

uint64_t env_count(const char* name, uint64_t fallback) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(env, &end, 10);
  if (*end != '\0') {
    log_always("ignoring %s=%s: expected a number of minibatches", name, env);
    return fallback;
  }
  return n;
}

}  // namespace

ProxySession::ProxySession()
    : enabled_(mode_is_proxy()),
      journal_(enabled_ ? replay_limit() : 0),
      replica_dir_(std::getenv("JITCKPT_REPLICA_DIR") ? std::getenv("JITCKPT_REPLICA_DIR") : ""),
      validate_at_(env_count("JITCKPT_VALIDATE_AT", 5)),
      validate_every_(env_count("JITCKPT_VALIDATE_EVERY", 0)) {}


// Called with recovery_mu_ held shared, so the generation cannot change meanwhile.
proxy::ProxyChannel* ProxySession::channel(std::string* why) {
  if (t_channel != nullptr && t_generation == generation_) return t_channel;
  std::lock_guard<std::mutex> lock(mu_);
  if (!start_locked(why)) return nullptr;
  const bool first = t_channel == nullptr;
  if (first) t_index = next_index_++;
  proxy::ProxyChannel* ch = channels_.get(t_index, why);
  if (ch == nullptr) return nullptr;
  t_channel = ch;
  t_generation = generation_;
  if (first && static_cast<pid_t>(syscall(SYS_gettid)) != getpid()) t_closer.armed = true;
  return t_channel;
}

int64_t ProxySession::last_journal_id() const { return t_last_journal_id; }

void ProxySession::close_channel(uint32_t index) {
  std::shared_lock<std::shared_mutex> shared(recovery_mu_);
  std::lock_guard<std::mutex> lock(mu_);
  // The current proxy's channel of this index (a replay may have opened it for the thread).
  proxy::ProxyChannel* ch = channels_.find(index);
  if (ch == nullptr) return;
  if (client_ != nullptr && client_->death().empty()) {
    const proxy::RequestHead head{ch->next_seq(), proxy::kNoReply, 0};
    // Everything the thread sent before is served first; a full ring after a second means the
    // proxy is stuck in an earlier call of this thread, and the channel stays as it is.
    if (!ch->post(static_cast<uint32_t>(proxy::Call::kCloseChannel), &head, sizeof head, std::chrono::seconds(1))
             .empty())
      return;
  }
  channels_.drop(index);  // a replay that needs this index opens a new channel for it
}

proxy::CallResult ProxySession::call(uint32_t tag, std::vector<uint8_t>& payload, bool no_reply, int fd,
                                     uint64_t fd_token, const SourceCopy* source) {
  proxy::CallResult r;
  if (!Registry::instance().tracking()) {  // a forked child: the rings are its parent's
    r.status = 999;
    r.error = "a process forked from a proxy-mode process cannot make CUDA calls (the proxy is its parent's)";
    return r;
  }
  const bool journaled = !ReplayJournal::stateless(tag);
  const bool ordered = journaled && ReplayJournal::ordered(tag);
  // Case 4: this rank took a replica's buffers of the next minibatch's start; the rest of this
  // minibatch's optimizer step must not change them again (JIT paper §4.2.2).
  if (skip_until_mark_.load(std::memory_order_relaxed) && ReplayJournal::work(tag)) return r;
  // The watchdog's queries (event queries, communicators' asynchronous errors) never wait for device
  // work: one the proxy does not answer within the hang timeout (at least a second) means the proxy
  // is hung or stopped, which nothing else would notice (every other call waits on it too).
  const bool watched = !journaled && Watchdog::on_watchdog_thread();
  const auto answer_within = std::chrono::milliseconds(
      static_cast<int64_t>(1000 * std::max(1.0, watched ? Registry::instance().hang_timeout() : 0.0)));
  // A replacement stage joins the survivors at its first communicator with peers (stage_join.h):
  // journaled as theirs (their recorded id), made with the id agreed with them.
  std::string joined_id;
  if (ReplayJournal::inits_comm_from_id(tag) && join_.pending() &&
      payload.size() >= ReplayJournal::kCommRankOffset + sizeof(int32_t)) {
    int32_t nranks = 0, rank = 0;
    std::memcpy(&nranks, payload.data() + sizeof(proxy::RequestHead) + 1, sizeof nranks);
    std::memcpy(&rank, payload.data() + ReplayJournal::kCommRankOffset, sizeof rank);
    std::string recorded;
    if (nranks > 1 && !join_survivors(nranks, rank, &recorded, &joined_id, &r.error)) {
      r.status = 999;
      r.error = "this replacement stage cannot join the survivors: " + r.error;
      return r;
    }
    if (nranks > 1) std::memcpy(payload.data() + ReplayJournal::kCommIdOffset, recorded.data(), recorded.size());
  }
  for (;;) {
    // Taken before the recovery lock and let go before a recovery: see ReplayJournal::ordered.
    std::unique_lock<std::mutex> order(order_mu_, std::defer_lock);
    if (ordered) order.lock();
    std::shared_lock<std::shared_mutex> shared(recovery_mu_);
    if (!lost_.empty()) {
      r.status = 999;
      r.error = lost_;
      return r;
    }
    std::string why;
    proxy::ProxyChannel* ch = channel(&why);
    if (ch == nullptr) {
      // The proxy died before this thread opened its channel to it: recovered as for any call of
      // this thread (nothing of this call was sent or journaled; it is made again on the new one).
      std::string died;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (client_ != nullptr) died = client_->death();
      }
      const uint64_t failed = generation_;
      shared.unlock();
      if (order.owns_lock()) order.unlock();
      proxy::CallResult ignored;
      if (!died.empty()) {
        RecoveringScope recovering(recovering_);
        if (recover(failed, -1, died, &ignored)) continue;
      }
      r.status = 999;
      r.error = why;
      return r;
    }
    const uint64_t generation = generation_;
    const uint64_t seq = ch->next_seq();
    const proxy::RequestHead head{seq, no_reply ? proxy::kNoReply : 0u, 0};
    std::memcpy(payload.data(), &head, sizeof head);
    const int64_t index = !journaled ? -1
                          : journal_.append(tag, t_index, seq, no_reply, payload.data(), payload.size(), fd, fd_token,
                                            source ? &source->source : nullptr, source ? source->bytes : nullptr,
                                            source ? source->size : 0);
    t_last_journal_id = index;
    if (!joined_id.empty()) std::memcpy(payload.data() + ReplayJournal::kCommIdOffset, joined_id.data(), joined_id.size());
    if (fd >= 0 && !client_->send_fd(fd, fd_token)) {
      r.status = 999;
      r.error = "cannot hand shared memory to the proxy: " + client_->death();
    } else if (no_reply) {
      r.error = ch->post(tag, payload.data(), payload.size(), kWhileTheProxyLives);
      if (!r.error.empty()) r.status = 999;
    } else if (watched) {
      wait_for_other_threads(ch);
      r = ch->call_raw(tag, payload.data(), payload.size(), seq, answer_within);
    } else {
      wait_for_other_threads(ch);
      if (waiting_.fetch_add(1) == 0) waiting_since_ns_ = std::chrono::steady_clock::now().time_since_epoch().count();
      r = ch->call_raw(tag, payload.data(), payload.size(), seq, kWhileTheProxyLives);
      waiting_.fetch_sub(1);
    }
    std::string death = r.status == 999 ? client_->death() : std::string();
    if (watched && r.status == 999 && death.empty()) death = kill_hung_proxy(generation, tag, answer_within);
    // A sticky CUDA error or an NCCL failure, with the journal able to rebuild the state alone (else
    // the caller gets the error, as without a proxy).
    std::string broken;
    bool device_fault = false, earlier = false;
    if (death.empty() && (r.status != 0 || r.async_status != 0)) {  // the common case stays lock-free
      broken = proxy_unusable(tag, r, &device_fault, &earlier);
      if (!broken.empty()) {
        if (std::string cannot = cannot_recover(); !cannot.empty()) {
          refused(generation, broken, cannot);
          broken.clear();
        }
      }
    }
    const bool sticky = !broken.empty();
    if (death.empty() && !sticky) {
      if (!no_reply) {
        journal_.completed(index, r);
        take_async_report(r);
      }
      // A communicator this process cannot rebuild (peers, no store) made since the fence was asked
      // for: lift it now, or a failure of its calls would leave the program without device work.
      if (ReplayJournal::inits_comm_from_id(tag) && fence_requested_ && !cannot_recover().empty() &&
          request_fence(ch, false))
        fence_requested_ = false;
      return r;
    }
    RecoveringScope recovering(recovering_);
    if (sticky && !device_fault) {  // NCCL failed; the device memory is readable
      // The proxy ran no device work after the failed call (it is fenced): its phase is what counts.
      int64_t failed = earlier ? journal_.find(t_index, r.async_seq, r.async_call) : index;
      if (earlier && failed < 0) failed = journal_.find_any_channel(r.async_seq, r.async_call);  // another thread's
      save_device(ch, generation, journal_.phase_of(failed), DeviceBuffers::WaitFor::kQueuedWork, failed);
    }
    if (sticky) {  // the proxy still runs: with a peer that cannot rebuild, user-level recovery takes over
      if (std::string no = agree_to_rebuild(generation); !no.empty()) {
        refused(generation, broken, no);
        if (!no_reply) take_async_report(r);
        return r;
      }
    }
    shared.unlock();
    if (order.owns_lock()) order.unlock();
    const std::string what = sticky ? broken : death;
    // Kill the useless proxy first: a thread blocked in a call on it then sees it die and lets
    // the recovery lock go, instead of holding it up.
    if (sticky) kill_proxy_for(generation, what);
    // A journaled call comes back with its replayed result; a stateless one is made again.
    proxy::CallResult replayed;
    if (recover(generation, index, what, &replayed)) {
      if (journaled) return replayed;
      continue;
    }
    if (!death.empty() && !death_reported_.exchange(true)) {
      log_always("proxy mode: %s; every CUDA/NCCL call of this process fails from now on (its device state "
                 "was in the proxy)", death.c_str());
    }
    if (!no_reply) take_async_report(r);
    return r;
  }
}

// Each thread has a channel of its own, which the proxy serves on a thread of its own, so a call
// posted without a reply (an event record, a launch) may still sit in its ring when another thread
// makes a synchronous call. On a GPU the work has reached the driver once the call returns: a
// thread that learns through host memory that another recorded an event (libjit.so's send-log
// writer; an allocator's event queries) sees the record in its cudaEventQuery. Here that holds only
// if the proxy has run what other threads posted first. Bounded: a posted call stuck in the proxy
// longer than a second holds up no other thread beyond that (the order is then not guaranteed).
void ProxySession::wait_for_other_threads(proxy::ProxyChannel* ch) {
  if (next_index_.load(std::memory_order_relaxed) <= 1) return;  // one thread: its ring is in order
  std::lock_guard<std::mutex> lock(mu_);  // the channels stay open meanwhile
  channels_.wait_for_posted(ch, std::chrono::steady_clock::now() + std::chrono::seconds(1));
}

std::string ProxySession::kill_hung_proxy(uint64_t generation, uint32_t tag, std::chrono::milliseconds waited) {
  const char* name = proxy::call_name(tag);
  std::lock_guard<std::mutex> lock(mu_);
  if (generation_ != generation || client_ == nullptr) return "";
  const pid_t pid = client_->pid();
  char text[200];
  std::snprintf(text, sizeof text, "jitckpt-proxy (pid %d) did not answer the watchdog's %s within %.1f s (hung or "
                "stopped); it was killed", static_cast<int>(pid), name ? name : "query", waited.count() / 1e3);
  {
    std::lock_guard<std::mutex> cause(kill_cause_mu_);
    kill_cause_ = {generation, text};  // before the kill: whichever thread finds the proxy dead first says it
  }
  kill(pid, SIGKILL);
  for (int i = 0; i < 200 && client_->death().empty(); ++i)  // bounded: 2 s to be reaped
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return text;
}

void ProxySession::kill_proxy_for(uint64_t generation, const std::string& cause) {
  std::lock_guard<std::mutex> lock(mu_);
  if (generation_ != generation || client_ == nullptr || !client_->death().empty()) return;
  {
    std::lock_guard<std::mutex> recorded(kill_cause_mu_);
    kill_cause_ = {generation, cause};
  }
  kill(client_->pid(), SIGKILL);
}

bool ProxySession::recover_now(const std::string& what) { return recover_live(what, false, false, nullptr); }

bool ProxySession::recover_from_hang(const std::string& what, bool posted_in_optimizer_step, cudaEvent_t sentinel) {
  // A replacement of a dead peer stage replays what this process sent (SWIFT): the log is written
  // out first. Bounded: the copy behind a hung send never completes; every completed one is
  // written within the bound.
  std::string log_error;
  if (Registry::instance().send_log().enabled() && !Registry::instance().send_log().flush(0.5, &log_error))
    log_always("send log at the failure: %s", log_error.c_str());
  return recover_live(what, true, posted_in_optimizer_step, sentinel);
}

std::string ProxySession::cannot_recover() const {
  if (std::string off = journal_.off_reason(); !off.empty()) return "the replay journal is off (" + off + ")";
  return journal_.cannot_replay(store_.available());
}

bool ProxySession::recover_live(const std::string& what, bool hung, bool posted_in_optimizer_step,
                                cudaEvent_t sentinel) {
  RecoveringScope recovering(recovering_);
  uint64_t generation;
  {
    std::shared_lock<std::shared_mutex> shared(recovery_mu_);
    if (!enabled_ || !lost_.empty() || client_ == nullptr) return false;
    if (std::string why = cannot_recover(); !why.empty()) {
      refused(generation_, what, why);
      return false;
    }
    generation = generation_;
    std::string why;
    // An asynchronous error: the device may have run anything posted since, so the phase is now's.
    // A hang: nothing after the collective ran; the phase it was posted in is what counts.
    ReplayJournal::Phase phase = journal_.phase();
    if (hung && phase != ReplayJournal::Phase::kUnmarked)
      phase = posted_in_optimizer_step ? ReplayJournal::Phase::kOptimizerStep : ReplayJournal::Phase::kMinibatch;
    if (proxy::ProxyChannel* ch = channel(&why)) {
      save_device(ch, generation, phase, hung ? DeviceBuffers::WaitFor::kNothing : DeviceBuffers::WaitFor::kQueuedWork);
      if (hung && sentinel != nullptr) distrust_save_if_complete(ch, generation, sentinel);
    }
    if (std::string no = agree_to_rebuild(generation); !no.empty()) {
      refused(generation, what, no);
      return false;  // the proxy lives on: the failure callback's user-level save reads it
    }
  }
  kill_proxy_for(generation, what);
  proxy::CallResult ignored;
  return recover(generation, -1, what, &ignored);
}

bool ProxySession::recover(uint64_t failed_generation, int64_t index, const std::string& what,
                           proxy::CallResult* out) {
  std::unique_lock<std::shared_mutex> exclusive(recovery_mu_);
  if (!lost_.empty()) return false;
  if (generation_ == failed_generation) {
    std::string why;
    RecoveryRecord record;
    record.cause = what;
    {
      std::lock_guard<std::mutex> cause(kill_cause_mu_);
      if (kill_cause_.first == failed_generation) record.cause = kill_cause_.second;
    }
    record.recovered = replay_locked(record.cause, &why, &record);
    if (!record.recovered) record.reason = why;
    if (record.recovered) {
      Registry::instance().collectives().restart_clocks();
      recoveries_.fetch_add(1);
      last_recovery_ns_ = std::chrono::steady_clock::now().time_since_epoch().count();
    }
    append_recovery_event(record);
    if (!record.recovered) {
      lost_ = "the device state of this process is lost: " + record.cause + "; transparent recovery failed: " + why;
      log_always("proxy mode: %s; every CUDA/NCCL call of this process fails from now on", lost_.c_str());
      death_reported_ = true;
      return false;
    }
  }
  auto it = replayed_.find(index);
  *out = it == replayed_.end() ? proxy::CallResult{} : std::move(it->second);  // a no-reply call: posted again
  if (it != replayed_.end()) replayed_.erase(it);
  return true;
}

bool ProxySession::replay_locked(const std::string& what, std::string* why, RecoveryRecord* record) {
  if (std::string no = agree_to_rebuild(generation_); !no.empty()) {
    *why = no;
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(vote_mu_);
    record->agree_s = vote_.seconds;
  }
  if (!take_replica_buffers(why)) return false;
  bool skip_minibatch = false;
  {
    std::lock_guard<std::mutex> lock(vote_mu_);
    skip_minibatch = vote_.generation == generation_ && vote_.skip_minibatch;
  }
  if (journal_.next_id() == journal_at_last_recovery_) {
    *why = "the same failure came back in the replay, before any new call (a fault in the program, not the device?)";
    return false;
  }
  bool restore = false;
  ReplayJournal::Phase phase = journal_.phase();
  std::vector<UndoLaunch> undo;  // the undo plugin's: the optimizer step's launches that ran, inverted
  bool undid = false;
  {
    std::lock_guard<std::mutex> lock(save_mu_);
    if (save_.generation == generation_) phase = save_.phase;
    const bool undone = save_.generation == generation_ && undo_.enabled() && save_.undoable();
    if (phase == ReplayJournal::Phase::kMinibatch || undone) {
      restore = true;
      record->save_s = save_.seconds;
    }
    if (undone) {
      undid = true;
      undo = std::move(save_.undo);
      phase = ReplayJournal::Phase::kMinibatch;  // from its start, once undone
    }
  }
  record->undone = undo.size();
  const auto t0 = std::chrono::steady_clock::now();
  record->calls = journal_.size();
  record->bytes = journal_.total_bytes();
  log_always("proxy mode: %s; starting a new jitckpt-proxy and replaying this process's %zu calls (%zu bytes)",
             what.c_str(), journal_.size(), journal_.total_bytes());
  std::lock_guard<std::mutex> lock(mu_);
  if (client_ != nullptr) {
    if (client_->death().empty()) kill(client_->pid(), SIGKILL);  // a sticky error: the old context is useless
    channels_.attach(nullptr);
    client_.reset();
  }
  if (!start_locked(why)) return false;
  const auto started = std::chrono::steady_clock::now();
  ++generation_;
  replayed_.clear();
  ReplayTarget target{*client_, channels_, [this] { return next_token(); }, /*private_memfds=*/false,
                      [this](const std::string& recorded, int rank, const std::string& fresh, std::string* agreed,
                             std::string* problem) { return agree_unique_id(recorded, rank, fresh, agreed, problem); },
                      peer_wait(), skip_minibatch, std::move(undo)};
  ReplayOutcome outcome;
  DeviceBuffers buffers;
  if (restore) {
    std::lock_guard<std::mutex> lock(save_mu_);
    buffers = std::move(save_.buffers);  // in the new proxy, or lost with it, after this
  }
  if (!replay_journal(journal_, target, restore ? &buffers : nullptr, &outcome, why)) return false;
  replayed_ = std::move(outcome.results);
  skip_until_mark_ = skip_minibatch;  // the rest of this minibatch's optimizer step is the replica's
  if (fence_requested_) {
    proxy::ProxyChannel* ch = channels_.get(0, why);
    if (ch == nullptr || !request_fence(ch, true)) {
      *why = "the new proxy did not take the fence request" + (why->empty() ? "" : ": " + *why);
      return false;
    }
  }
  journal_at_last_recovery_ = journal_.next_id();
  using S = std::chrono::duration<double>;
  const auto done = std::chrono::steady_clock::now();
  record->new_proxy_s = S(started - t0).count();
  if (phase == ReplayJournal::Phase::kMinibatch) {
    record->recreate_s = S(outcome.recreated - started).count();
    record->restore_s = S(outcome.restored - outcome.recreated).count();
    record->replay_s = S(outcome.replayed - outcome.restored).count();
  } else {
    record->replay_s = S(outcome.replayed - started).count();
  }
  record->synchronize_s = S(done - outcome.replayed).count();
  record->total_s = S(done - t0).count() + record->save_s + record->agree_s;
  const size_t minibatch_calls = outcome.minibatch_calls;
  record->minibatch_calls = minibatch_calls;
  record->communicators_s = outcome.communicators_s;
  std::string scope = phase == ReplayJournal::Phase::kUnmarked
                          ? std::string("every call since the first: no minibatch marks")
                          : std::to_string(minibatch_calls) + " of this minibatch";
  if (skip_minibatch)
    scope = "not this minibatch's " + std::to_string(minibatch_calls) + ": a replica finished it, its buffers were "
            "taken, and the rest of its optimizer step is skipped";
  else if (!save_.from_replica.empty())
    scope += ", on a replica's buffers";
  else if (undid)
    scope += ", after undoing the " + std::to_string(record->undone) + " launch(es) of its optimizer step that had run "
             "(--plugin undo)";
  log_always("proxy mode: recovered: jitckpt-proxy pid %d took over after replaying %zu calls (%s) in %.1f ms (save "
             "buffers %.1f ms, new proxy %.1f ms, recreate handles and communicators %.1f ms, restore buffers %.1f "
             "ms, replay %.1f ms, device synchronize %.1f ms; of them, waiting for the peers' word %.1f ms, "
             "communicators' inits %.1f ms)",
             static_cast<int>(client_->pid()), journal_.size(), scope.c_str(), record->total_s * 1e3, record->save_s * 1e3,
             record->new_proxy_s * 1e3, record->recreate_s * 1e3, record->restore_s * 1e3, record->replay_s * 1e3,
             record->synchronize_s * 1e3, record->agree_s * 1e3, record->communicators_s * 1e3);
  death_reported_ = false;
  return true;
}

void ProxySession::mark_minibatch() {
  if (!enabled_) return;
  std::vector<ReplayJournal::DeviceRange> live = device_allocations();
  std::shared_lock<std::shared_mutex> shared(recovery_mu_);  // not while a replay reads the journal
  // A second mark with no call since the first (the Python runtime's and the program's own) is one.
  if (journal_.phase() == ReplayJournal::Phase::kMinibatch && journal_.next_id() == journal_.minibatch_start()) return;
  journal_.mark_minibatch(std::move(live));
  undo_.minibatch();
  ++minibatches_;
  skip_until_mark_ = false;
  if (validate_at_ > 0 && (minibatches_ == validate_at_ ||
                           (validate_every_ > 0 && minibatches_ > validate_at_ &&
                            (minibatches_ - validate_at_) % validate_every_ == 0)))
    start_validation();
  // The fence only while a failed NCCL call would be recovered here (no communicator with peers
  // elsewhere, the journal on): else the program gets the error and may go on, as without a proxy.
  // On this thread's channel, once it has one (a mark must not start a proxy nobody else needs).
  const bool fence = cannot_recover().empty();
  if (fence != fence_requested_ && t_channel != nullptr && t_generation == generation_ && request_fence(t_channel, fence))
    fence_requested_ = fence;
}

bool ProxySession::request_fence(proxy::ProxyChannel* ch, bool on) {
  struct {
    proxy::RequestHead head;
    proxy::FenceArg arg;
  } request{{ch->next_seq(), 0u, 0}, {on ? 1u : 0u, 0}};
  return ch->call_raw(static_cast<uint32_t>(proxy::Call::kFence), &request, sizeof request, request.head.seq).status == 0;
}

void ProxySession::mark_optimizer_step() {
  if (!enabled_) return;
  {
    std::shared_lock<std::shared_mutex> shared(recovery_mu_);
    journal_.mark_optimizer_step();
    undo_.optimizer_step();
    if (validation_start_.empty() || validation_mark_ != journal_.minibatch_start()) return;
  }
  validate();
}

std::vector<ReplayJournal::DeviceRange> ProxySession::device_allocations() const {
  std::vector<ReplayJournal::DeviceRange> live;
  std::lock_guard<std::mutex> lock(memory_mu_);
  for (const auto& [base, range] : memory_)
    if (range.kind == Memory::kDevice) live.push_back({base, range.size});
  return live;
}

// Under recovery_mu_ shared, right after the minibatch's mark.
void ProxySession::start_validation() {
  validation_start_ = DeviceBuffers{};
  // Only on a thread that has a channel (a mark must not start a proxy), and where a scratch proxy
  // can replay alone.
  // With peers elsewhere, every rank validates at this minibatch, their scratch proxies together.
  if (t_channel == nullptr || t_generation != generation_ || !cannot_recover().empty()) return;
  // A replacement stage counts its minibatches from the global checkpoint, so its scratch
  // communicator would wait for peers validating at another one; the survivors validated the
  // program already.
  if (join_.joined()) {
    log_always("proxy mode: no replay validation at minibatch %llu: this replacement stage joined survivors that "
               "validated the program's replay", static_cast<unsigned long long>(minibatches_));
    return;
  }
  std::string why;
  if (!validation_start_.save(*client_, *t_channel, next_token(), journal_.allocations_at_mark(),
                              std::chrono::seconds(60), &why)) {
    log_always("proxy mode: no replay validation at minibatch %llu: %s", static_cast<unsigned long long>(minibatches_),
               why.c_str());
    return;
  }
  validation_mark_ = journal_.minibatch_start();
}

void ProxySession::validate() {
  RecoveringScope busy(recovering_);  // a hang watchdog elsewhere (the Python runtime's) waits for it too
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::shared_mutex> exclusive(recovery_mu_);  // the journal holds still
  DeviceBuffers start = std::move(validation_start_);
  validation_mark_ = UINT64_MAX;
  if (!lost_.empty() || !journal_.on() || t_channel == nullptr || t_generation != generation_) return;
  ValidationRecord record;
  record.minibatch = minibatches_;
  record.calls = journal_.size();
  // The live proxy's buffers now, and the same allocations after a replay in a scratch proxy.
  const std::vector<ReplayJournal::DeviceRange> live = device_allocations();
  DeviceBuffers after;
  std::string why;
  if (!after.save(*client_, *t_channel, next_token(), live, std::chrono::seconds(60), &why)) {
    log_always("proxy mode: no replay validation at minibatch %llu: %s", static_cast<unsigned long long>(minibatches_),
               why.c_str());
    return;
  }
  record.bytes = after.bytes();
  // What the recovery of a failure found now would start from: the allocations of the minibatch's
  // start as they are now. A replay from there must give the same buffers too, or the minibatch
  // changes them in place before its optimizer step (running statistics) and a recovery would
  // apply that change twice.
  DeviceBuffers at_failure;
  if (!at_failure.save(*client_, *t_channel, next_token(), journal_.allocations_at_mark(), std::chrono::seconds(60),
                       &why)) {
    log_always("proxy mode: no replay validation at minibatch %llu: %s", static_cast<unsigned long long>(minibatches_),
               why.c_str());
    return;
  }
  // Replays the journal into a scratch proxy on top of `from`; the first difference from `after`
  // ("" if none), or false with `problem` if the replay could not be made.
  auto replay_from = [&](uint64_t replay, const DeviceBuffers& from, std::string* difference, std::string* problem) {
    bool made = false;
    try {
      const std::vector<std::string> env = proxy_environment(/*scratch=*/true);
      std::unique_ptr<proxy::ProxyClient> scratch =
          proxy::ProxyClient::start(proxy_binary(), std::chrono::seconds(30), &env);
      IndexedChannels channels;
      channels.attach(scratch.get());
      // Communicators with peers elsewhere are made with theirs, in their scratch proxies.
      ReplayTarget target{*scratch, channels, [this] { return next_token(); }, /*private_memfds=*/true,
                          [this, replay](const std::string& recorded, int rank, const std::string& fresh,
                                         std::string* agreed, std::string* problem) {
                            return agree_scratch_id(replay, recorded, rank, fresh, agreed, problem);
                          },
                          std::chrono::seconds(60), /*skip_minibatch=*/false, /*undo=*/{}};
      ReplayOutcome outcome;
      DeviceBuffers replayed;
      if (!replay_journal(journal_, target, &from, &outcome, problem)) {
        *problem = "the replay into a scratch proxy failed: " + *problem;
      } else if (proxy::ProxyChannel* ch = channels.get(0, problem);
                 ch == nullptr || !replayed.save(*scratch, *ch, next_token(), live, std::chrono::seconds(60), problem)) {
        *problem = "cannot read the scratch proxy's buffers: " + *problem;
      } else {
        *difference = after.first_difference(replayed);
        made = true;
      }
      kill(scratch->pid(), SIGKILL);  // nothing of it is needed; its destructor reaps it
    } catch (const std::exception& e) {
      *problem = std::string("cannot start a scratch proxy: ") + e.what();
    }
    return made;
  };
  // Case 3's check, with one communicator with peers (its data-parallel group): its rank 0's
  // buffers of this minibatch's start, replayed here, must give this rank's buffers too; else a
  // replica's cannot stand in for this rank's (they hold something of this rank's own).
  const std::vector<ReplayJournal::PeerComm> comms = journal_.peer_comms();
  const bool check_replica = comms.size() == 1 && store_.available() && !replica_dir_.empty();
  DeviceBuffers replica_start;
  std::string replica_problem;
  if (check_replica) {
    const std::string key = comm_key("validate-replica", comms[0].id, minibatches_);
    std::string path;
    if (comms[0].rank == 0) {
      path = replica_dir_ + "/validate-" + std::to_string(getpid()) + "-" + std::to_string(minibatches_) + ".buffers";
      if (!start.write_file(path, &replica_problem)) path.clear();
      store_.set(key, path, &replica_problem);  // "" tells the others there is nothing to read
    } else if (!store_.get(key, std::chrono::seconds(30), &path, &replica_problem) ||
               (path.empty() && (replica_problem = "rank 0 could not write its buffers", true)) ||
               !replica_start.read_file(path, journal_.allocations_at_mark(), &replica_problem)) {
      replica_start = DeviceBuffers{};
    }
  }
  // Every replay always runs: with peers elsewhere, theirs wait for this one's.
  std::string difference, from_failure, failure_why, from_replica, replica_why;
  const bool made = replay_from(0, start, &difference, &why);
  const bool made_from_failure = replay_from(1, at_failure, &from_failure, &failure_why);
  if (check_replica) {
    const bool mine = comms[0].rank == 0 || replica_start.empty();
    if (!replay_from(2, mine ? start : replica_start, &from_replica, &replica_why)) {
      replica_check_ = "replaying on a replica's buffers failed: " + replica_why;
    } else if (comms[0].rank != 0 && replica_start.empty()) {
      replica_check_ = "rank 0's buffers of minibatch " + std::to_string(minibatches_) + " were not read: " +
                       replica_problem;
    } else if (!from_replica.empty()) {
      replica_check_ = "replayed on rank 0's buffers of minibatch " + std::to_string(minibatches_) + "'s start, " +
                       from_replica + " (the buffers hold something of this rank's own)";
    } else {
      replica_check_.clear();
    }
  }
  if (!made) {
    record.detail = why;
  } else if (!difference.empty()) {
    record.detail = difference + " (the program's device work depends on something the journal does not hold, such "
                    "as host memory a kernel reads directly, or is not deterministic)";
  } else if (!made_from_failure) {
    record.detail = failure_why;
  } else if (difference = from_failure; !difference.empty()) {
    record.detail = "replayed on the buffers of its start as a failure before the optimizer step would find them, " +
                    difference + " (the minibatch changes buffers that outlive it in place before its optimizer "
                    "step, such as running statistics: a recovery would apply that change twice)";
  } else {
    record.matched = true;
  }
  record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  append_validation_event(record);
  if (record.matched) {
    log_always("proxy mode: replay validation at minibatch %llu: replaying its %zu calls on the buffers of its start "
               "gave all %.2f MiB of device buffers bitwise, also from their state before its optimizer step%s (%.1f "
               "ms)",
               static_cast<unsigned long long>(minibatches_), record.calls, static_cast<double>(record.bytes) / (1 << 20),
               !check_replica ? "" : replica_check_.empty() ? ", and from rank 0's" : "; not from rank 0's",
               record.seconds * 1e3);
    if (check_replica && !replica_check_.empty())
      log_always("proxy mode: a replica's buffers cannot stand in for this rank's if its proxy is lost: %s",
                 replica_check_.c_str());
    return;
  }
  journal_.turn_off("replay validation at minibatch " + std::to_string(minibatches_) + " failed: " + record.detail +
                    "; failures are handled by user-level JIT checkpointing");
}

void ProxySession::save_device(proxy::ProxyChannel* ch, uint64_t generation, ReplayJournal::Phase phase,
                               DeviceBuffers::WaitFor wait, int64_t failed) {
  std::lock_guard<std::mutex> lock(save_mu_);
  if (save_.generation == generation) return;  // another thread's failure came first
  save_ = DeviceSave{};
  save_.generation = generation;
  save_.phase = phase;
  // A full replay, or, in the optimizer step, of no use without the undo plugin.
  const bool undo = phase == ReplayJournal::Phase::kOptimizerStep && undo_.enabled();
  if (phase != ReplayJournal::Phase::kMinibatch && !undo) return;
  const auto t0 = std::chrono::steady_clock::now();
  // Bounded: a device that does not finish its queued work is not one to copy from.
  if (!save_.buffers.save(*client_, *ch, next_token(), journal_.allocations_at_mark(), std::chrono::seconds(60),
                          &save_.failure, wait))
    return;
  // After the copies: with kQueuedWork the device has finished what it would run by now.
  if (undo) undo_.plan(*ch, journal_, failed, &save_.undo, &save_.undo_problem);
  save_.saved = true;
  save_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void ProxySession::distrust_save_if_complete(proxy::ProxyChannel* ch, uint64_t generation, cudaEvent_t sentinel) {
  std::string error;
  const int status = query_event(*ch, sentinel, &error);
  if (status == cudaErrorNotReady) return;  // nothing behind the collective ran during the copies
  std::lock_guard<std::mutex> lock(save_mu_);
  if (save_.generation != generation || !save_.saved) return;
  save_.saved = false;
  save_.undo.clear();
  save_.failure = status == cudaSuccess
                      ? "the collective taken as hung completed while its buffers were copied (its stream was only "
                        "slow), so the copies may hold part of the work queued behind it"
                      : "cannot tell whether the collective taken as hung ran on (cudaEventQuery: " +
                            (error.empty() ? std::to_string(status) : error) + ")";
}

void ProxySession::refused(uint64_t generation, const std::string& what, const std::string& reason) {
  if (refused_generation_.exchange(generation) == generation) return;  // said already
  RecoveryRecord record;
  record.cause = what;
  record.reason = reason;
  append_recovery_event(record);
  log_always("proxy mode: %s; not recovered transparently: %s; the program gets the error, and user-level recovery "
             "takes over", what.c_str(), record.reason.c_str());
}

double ProxySession::waiting_for_s() const {
  if (waiting_.load() == 0) return 0;
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch() -
                                       std::chrono::steady_clock::duration(waiting_since_ns_.load()))
      .count();
}

void ProxySession::write_status(JsonWriter& w) const {
  w.begin_object();
  w.key("recoverable").value(enabled_ && cannot_recover().empty());
  w.key("recovering").value(recovering_.load() > 0);
  w.key("recoveries").value(recoveries_.load());
  w.key("since_last_s");
  if (const int64_t last = last_recovery_ns_.load(); last != 0)
    w.value(std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch() -
                                          std::chrono::steady_clock::duration(last)).count());
  else
    w.null();
  w.end_object();
}

std::string ProxySession::why_not_rebuildable(uint64_t generation, bool* from_replica) {
  if (from_replica) *from_replica = false;
  if (std::string cannot = cannot_recover(); !cannot.empty()) return cannot;
  // With minibatch marks the journal holds only the current minibatch's device work: the buffers'
  // contents at its start come from the old proxy (save_device), or from a replica (case 3).
  ReplayJournal::Phase phase = journal_.phase();
  std::lock_guard<std::mutex> lock(save_mu_);
  const bool from_live_proxy = save_.generation == generation;  // its buffers could be read
  if (from_live_proxy) phase = save_.phase;                       // the failed call's
  if (phase == ReplayJournal::Phase::kUnmarked) return "";  // every call replayed: no buffers needed
  if (from_live_proxy && phase == ReplayJournal::Phase::kOptimizerStep) {
    if (undo_.enabled() && save_.undoable()) return "";  // undone in the new proxy, then replayed
    return "the failure was found during the optimizer step, which changes parameters and optimizer state in "
           "place (they may be partly updated), and its proxy's peers are in the same step (no replica finished it)" +
           (!undo_.enabled() ? std::string("; `--plugin undo` with the kernels' inverses registered (jitckpt/undo.h) "
                                           "would undo the partial step")
                             : "; --plugin undo cannot undo it: " + (save_.saved ? save_.undo_problem : save_.failure));
  }
  if (from_live_proxy && save_.saved) return "";
  // The buffers are lost with the proxy (or could not be copied out of it: a sticky error found
  // first as a communicator's error). They come from a replica: of this minibatch's start if the
  // replica is still in it (case 3; this rank's optimizer step, if begun, had not got past the
  // collective the replica waits in), else of the next one's (case 4; agree_to_rebuild tells which).
  if (std::string no = replica_unavailable(); !no.empty())
    return (from_live_proxy ? "the buffers of the minibatch's start could not be copied out of the proxy (" +
                                  save_.failure + ")"
                            : std::string("the parameters and optimizer state were in the lost proxy's device memory "
                                          "(the journal holds only this minibatch's work since minibatch marks "
                                          "began)")) +
           ", and no data-parallel replica can give them: " + no;
  if (from_replica) *from_replica = true;
  return "";
}

std::string ProxySession::comm_key(const char* what, const std::string& id) const {
  // Every rank of the communicator rebuilds it together, so they count its rebuilds alike.
  auto it = comm_rebuilds_.find(id);
  return comm_key(what, id, it == comm_rebuilds_.end() ? 0 : it->second);
}

std::string ProxySession::comm_key(const char* what, const std::string& id, uint64_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string key = std::string("jitckpt/transparent/") + what + "/";
  for (unsigned char c : id) {
    key += kHex[c >> 4];
    key += kHex[c & 15];
  }
  return key + "/" + std::to_string(n);
}

std::string ProxySession::replica_unavailable() const {
  const size_t comms = journal_.peer_comms().size();
  if (comms != 1)
    return "this rank has " + std::to_string(comms) + " communicators with peers in other processes (a replica is "
           "taken from the only one, its data-parallel group)";
  if (!store_.available() || replica_dir_.empty())
    return "no store and directory shared with the replicas (JITCKPT_STORE_SOCKET, JITCKPT_REPLICA_DIR: `jitckpt run "
           "--transparent` sets them)";
  return replica_check_;
}


std::string ProxySession::agree_to_rebuild(uint64_t generation) {
  std::lock_guard<std::mutex> lock(vote_mu_);
  if (vote_.generation == generation) return vote_.verdict;
  const auto t0 = std::chrono::steady_clock::now();
  bool from_replica = false;
  const std::string mine = why_not_rebuildable(generation, &from_replica);
  std::string verdict = mine;
  const std::vector<ReplayJournal::PeerComm> comms = journal_.peer_comms();
  Vote vote;
  if (!comms.empty() && store_.available()) {
    // Every rank says its word first (a "no" reaches the peers at once), then reads the others':
    // "yes/<minibatch>" (it has its buffers), "replica/<minibatch>[/optimizer]" (it lost them), or
    // "no: <why>". Every rank applies the same rule to the same words, so all decide alike.
    std::string text = "no: " + mine;
    if (mine.empty()) {
      text = (from_replica ? "replica/" : "yes/") + std::to_string(minibatches_.load());
      if (journal_.phase() == ReplayJournal::Phase::kOptimizerStep) text += "/optimizer";
      std::lock_guard<std::mutex> lock(save_mu_);
      if (!from_replica && save_.generation == generation && save_.undoable()) text += "/undo";
      // A replacement of a dead stage replays the logs through the iteration before this one.
      if (join_.logging()) text += "/it" + std::to_string(Registry::instance().log_context().get().iteration);
    }
    for (const ReplayJournal::PeerComm& c : comms) {
      std::string problem;
      if ((!store_.set(comm_key("vote", c.id) + "/" + std::to_string(c.rank), text, &problem) ||
           !store_.set(comm_key("vote", c.id) + "/found", std::to_string(c.rank), &problem)) &&
          verdict.empty())
        verdict = "cannot tell the communicator's other ranks: " + problem;
    }
    // The peers find the failure by the word above or their hang timeout; one that never answers is gone.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30) +
                          std::chrono::milliseconds(static_cast<int64_t>(2000 * Registry::instance().hang_timeout()));
    for (const ReplayJournal::PeerComm& c : comms) {
      std::vector<VoteWord> words(static_cast<size_t>(c.nranks));
      std::map<int, std::string> newcomers;  // rank -> nonce
      for (int r = 0; r < c.nranks && verdict.empty(); ++r) {
        std::string got = text, problem, nonce;
        if (r != c.rank && !peer_word(c, r, deadline, &got, &nonce, &problem)) {
          verdict = "rank " + std::to_string(r) + " of a communicator of " + std::to_string(c.nranks) +
                    " did not join the transparent recovery (" + problem + ")";
          break;
        }
        if (!nonce.empty()) newcomers[r] = nonce;
        words[static_cast<size_t>(r)] = VoteWord::parse(got);
        if (words[static_cast<size_t>(r)].kind == VoteWord::kNo && r != c.rank)  // the others need not be read
          verdict = words[static_cast<size_t>(r)].refusal(r, c.nranks);
      }
      if (!verdict.empty()) break;
      const RebuildPlan plan = plan_rebuild(words, comms.size());
      verdict = plan.refusal;
      // The lowest survivor gives the newcomers the terms (they wait for them, see stage_join.h).
      const auto survivor = std::find_if(words.begin(), words.end(), [](const VoteWord& w) { return w.kind != VoteWord::kNew; });
      if (verdict.empty() && !newcomers.empty() && survivor - words.begin() == c.rank) {
        auto it = comm_rebuilds_.find(c.id);
        const StageJoin::Terms terms{c.id, it == comm_rebuilds_.end() ? 0 : it->second, plan.through};
        std::string problem;
        for (const auto& [r, nonce] : newcomers)
          if (verdict.empty() && !StageJoin::offer(store_, nonce, terms, &problem))
            verdict = "cannot give the replacement of rank " + std::to_string(r) + " its terms: " + problem;
        if (verdict.empty())
          log_always("proxy mode: rank(s) of a communicator of %d replaced; they replay the logs through iteration "
                     "%lld and join at the next", c.nranks, static_cast<long long>(plan.through));
      }
      if (verdict.empty() && plan.receives(c.rank)) {
        vote.replica_key = comm_key("replica", c.id);
        vote.skip_minibatch = plan.skip[static_cast<size_t>(c.rank)];
      }
      if (verdict.empty() && !plan.receivers.empty() && plan.donor == c.rank) {
        std::lock_guard<std::mutex> lock(save_mu_);
        const std::string path =
            replica_dir_ + "/replica-" + std::to_string(getpid()) + "-" + std::to_string(generation) + ".buffers";
        std::string problem;
        if (!save_.saved || !save_.buffers.write_file(path, &problem) ||
            !store_.set(comm_key("replica", c.id), path, &problem))
          verdict = "cannot give this rank's buffers to the ranks that lost theirs: " +
                    (save_.saved ? problem : save_.failure);
      }
    }
  }
  vote.generation = generation;
  vote.verdict = verdict;
  vote.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  vote_ = vote;
  return verdict;
}

bool ProxySession::peer_word(const ReplayJournal::PeerComm& c, int r, std::chrono::steady_clock::time_point deadline,
                             std::string* word, std::string* nonce, std::string* why) {
  const std::string key = comm_key("vote", c.id) + "/" + std::to_string(r);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (!join_.logging()) return store_.get(key, std::max(left, std::chrono::milliseconds(1)), word, why);
    // Either its word or its replacement comes: look for both, a slice at a time.
    if (join_.arrived(store_, c.nranks, r, nonce)) {
      *word = "new";
      return true;
    }
    if (store_.get(key, std::min(std::max(left, std::chrono::milliseconds(1)), std::chrono::milliseconds(50)), word, why))
      return true;
    if (left.count() <= 0) return false;
  }
}

bool ProxySession::join_survivors(int nranks, int rank, std::string* recorded, std::string* agreed, std::string* why) {
  StageJoin::Terms terms;
  if (!store_.available()) {
    *why = "no store shared with the survivors (JITCKPT_STORE_SOCKET: `jitckpt run --transparent` sets it)";
    return false;
  }
  log_always("proxy mode: this process replaces a dead stage; waiting for the survivors' terms");
  if (!join_.join(store_, nranks, rank, peer_wait(), &terms, why)) return false;
  Registry::instance().recv_replay().set_through(terms.through);
  std::string fresh;
  if (rank == 0) {
    std::shared_lock<std::shared_mutex> shared(recovery_mu_);
    proxy::ProxyChannel* ch = channel(why);
    if (ch == nullptr || (fresh = fresh_unique_id(*ch, why)).empty()) return false;
  }
  std::unique_lock<std::shared_mutex> exclusive(recovery_mu_);  // comm_rebuilds_
  comm_rebuilds_[terms.id] = terms.rebuilds;
  *recorded = terms.id;
  if (!agree_unique_id(terms.id, rank, fresh, agreed, why)) return false;
  log_always("proxy mode: joined the survivors' communicator (rank %d of %d); replaying receives through iteration "
             "%lld from the neighbours' send logs", rank, nranks, static_cast<long long>(terms.through));
  return true;
}

bool ProxySession::take_replica_buffers(std::string* why) {
  std::string key;
  {
    std::lock_guard<std::mutex> lock(vote_mu_);
    if (vote_.generation != generation_ || vote_.replica_key.empty()) return true;  // not a receiver
    key = vote_.replica_key;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::string path;
  DeviceBuffers buffers;
  if (!store_.get(key, peer_wait(), &path, why) || !buffers.read_file(path, journal_.allocations_at_mark(), why)) {
    *why = "no buffers from a data-parallel replica: " + *why;
    return false;
  }
  std::lock_guard<std::mutex> lock(save_mu_);
  save_ = DeviceSave{};
  save_.generation = generation_;
  save_.phase = ReplayJournal::Phase::kMinibatch;
  save_.saved = true;
  save_.buffers = std::move(buffers);
  save_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  save_.from_replica = path;
  return true;
}

std::string ProxySession::peer_found_failure() {
  std::shared_lock<std::shared_mutex> shared(recovery_mu_);  // comm_rebuilds_ holds still
  if (!enabled_ || !store_.available() || !lost_.empty()) return "";
  for (const ReplayJournal::PeerComm& c : journal_.peer_comms()) {
    std::string rank, ignored;
    if (store_.get(comm_key("vote", c.id) + "/found", std::chrono::milliseconds(0), &rank, &ignored) &&
        rank != std::to_string(c.rank))
      return "rank " + rank + " of a communicator of " + std::to_string(c.nranks) + " found a failure";
    // --plugin logging: a replacement of a dead peer stage says so before any hang timeout would.
    for (int r = 0; r < c.nranks && join_.logging(); ++r)
      if (r != c.rank && join_.announced(store_, c.nranks, r))
        return "rank " + std::to_string(r) + " of a communicator of " + std::to_string(c.nranks) +
               " died and its replacement is waiting to join";
  }
  return "";
}

std::chrono::milliseconds ProxySession::peer_wait() const {
  // The peers find the failure by their hang timeout, then save, start a proxy and replay as this
  // process does: a minute beyond two hang timeouts is plenty, and bounds a peer that never comes.
  return std::chrono::milliseconds(60'000 + static_cast<int64_t>(2000 * Registry::instance().hang_timeout()));
}

bool ProxySession::agree_unique_id(const std::string& recorded_id, int rank, const std::string& fresh,
                                   std::string* agreed, std::string* why) {
  const std::string key = comm_key("comm", recorded_id);
  ++comm_rebuilds_[recorded_id];
  if (rank == 0) {
    *agreed = fresh;
    return store_.set(key, fresh, why);
  }
  return store_.get(key, peer_wait(), agreed, why);
}

bool ProxySession::agree_scratch_id(uint64_t replay, const std::string& recorded_id, int rank, const std::string& fresh,
                                    std::string* agreed, std::string* why) {
  // Every rank validates at the same minibatch and replays twice: (minibatch, replay) names the
  // scratch communicator. The peers are at their optimizer step marks too, give or take a step.
  const std::string key = comm_key("validate", recorded_id, minibatches_ * 2 + replay);
  if (rank == 0) {
    *agreed = fresh;
    return store_.set(key, fresh, why);
  }
  return store_.get(key, std::chrono::seconds(30), agreed, why);
}

void ProxySession::take_async_report(const proxy::CallResult& r) {
  if (r.async_status == 0) return;
  const char* name = proxy::call_name(r.async_call);
  log_always("proxy mode: an earlier asynchronous call failed: %s (call #%llu) returned %d", name ? name : "?",
             static_cast<unsigned long long>(r.async_seq), r.async_status);
}

void* ProxySession::pinned_hint(size_t size) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  void* hint = reinterpret_cast<void*>(next_pinned_);
  next_pinned_ += (size + (2u << 20) - 1) / (2u << 20) * (2u << 20);
  return hint;
}

void ProxySession::add_memory(uintptr_t base, size_t size, Memory kind) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  memory_[base] = Range{size, kind};
}

bool ProxySession::remove_memory(uintptr_t base, Memory kind, size_t* size) {
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.find(base);
  if (it == memory_.end() || it->second.kind != kind) return false;
  if (size) *size = it->second.size;
  memory_.erase(it);
  return true;
}

ProxySession::Memory ProxySession::memory_of(const void* p, size_t count) const {
  const auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.upper_bound(a);
  if (it == memory_.begin()) return Memory::kPageable;
  --it;
  if (a - it->first >= it->second.size || count > it->second.size - (a - it->first)) return Memory::kPageable;
  return it->second.kind;
}

bool ProxySession::overlaps_memory(uintptr_t base, size_t size) const {
  std::lock_guard<std::mutex> lock(memory_mu_);
  auto it = memory_.lower_bound(base + size);  // the first range starting at or after the end
  if (it == memory_.begin()) return false;
  --it;  // the last range starting before the end: the only one that can reach into [base, ...)
  return it->first + it->second.size > base;
}

bool proxy_mode_resolve(const char* name, void** fn) {
  if (!Registry::instance().proxy().enabled()) return false;
  *fn = proxy_mode::forwarder(name);
  if (*fn == nullptr) *fn = proxy_mode::extra_forwarder(name);
  return true;
}

}  // namespace jitckpt
