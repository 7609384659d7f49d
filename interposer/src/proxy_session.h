// Proxy mode's connection to the device proxy (issue 15): started on the first CUDA call of a
// process run with JITCKPT_MODE=proxy. Each thread that makes calls gets its own channel (a ring
// pair the proxy serves on a thread of its own), so a thread blocked in a synchronize does not
// hold up another thread's calls, and per-thread state (the current device, the per-thread
// default stream) stays per thread in the proxy. Also the tables the client keeps to classify
// pointers without a round trip: the device allocations the proxy handed out and the pinned
// buffers shared with it.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "device_buffers.h"
#include "host_registration.h"
#include "indexed_channels.h"
#include "proxy_client.h"
#include "proxy_kernels.h"
#include "recovery_event.h"
#include "rendezvous_store.h"
#include "replay_journal.h"
#include "stage_join.h"
#include "update_undo.h"

namespace jitckpt {

class JsonWriter;

class ProxySession {
 public:
  // kPinned: from cudaHostAlloc/cudaMallocHost; kRegistered: whole pages around a cudaHostRegister.
  enum class Memory { kPageable, kDevice, kPinned, kRegistered };

  ProxySession();  // reads JITCKPT_MODE
  bool enabled() const { return enabled_; }
  ProxyKernels& kernels() { return kernels_; }
  HostRegistrations& registrations() { return registrations_; }
  UpdateUndo& undo() { return undo_; }
  // The journal id of this thread's last call (-1 if it was not journaled).
  int64_t last_journal_id() const;

  // A copy from host memory the proxy shares, and the bytes it reads (see ReplayJournal::HostSource).
  struct SourceCopy {
    ReplayJournal::HostSource source;
    const void* bytes;
    size_t size;
  };

  // One request; `payload` starts with room for its RequestHead, which this fills in. A kNoReply
  // request returns once it is in the ring (status 0, or a transport failure). `fd` >= 0 is handed
  // over on the socket first (pinned memory). Starts the proxy on first use. Every request goes in
  // the replay journal; if the proxy dies or its device gets a sticky error, a new proxy is started,
  // the journal replayed into it, and the call returns what its replay returned (issue 16).
  proxy::CallResult call(uint32_t tag, std::vector<uint8_t>& payload, bool no_reply, int fd = -1,
                         uint64_t fd_token = 0, const SourceCopy* source = nullptr);
  uint64_t next_token() { return ++tokens_; }
  // The proxy's state is unusable though its calls succeed (the watchdog found a communicator's
  // asynchronous error): replace it now, if the journal can rebuild the state alone. False: the
  // failure is the caller's to handle, as without a proxy.
  bool recover_now(const std::string& what);
  // A collective hung (the watchdog's hang timeout; a peer failed): the same, with the buffers
  // copied without waiting for the device, whose work is blocked behind the collective. The phase
  // the collective was posted in decides: the optimizer step's work is assumed queued behind it,
  // as frameworks order it (cudaStreamWaitEvent after the all-reduce, JIT paper Fig. 3).
  // `sentinel` (the event recorded behind the collective) still pending after the copies shows
  // that nothing queued behind it ran meanwhile; complete, the collective was only slow to be seen
  // complete, and the copies may hold some of what followed it: they are not used.
  bool recover_from_hang(const std::string& what, bool posted_in_optimizer_step, cudaEvent_t sentinel);
  // Whether a rank of a communicator with peers elsewhere has found a failure (its word is in the
  // launcher's store): this rank's pending collective will not complete, and need not wait for the
  // hang timeout to know. Who found it, or "".
  std::string peer_found_failure();
  // Minibatch marks (jitckpt_mark_minibatch(), the Python runtime's step hooks): the journal keeps
  // only the current minibatch's device work from here on (see ReplayJournal).
  void mark_minibatch();
  void mark_optimizer_step();
  // For status(): {"recoverable", "recovering" (a recovery or a replay validation under way),
  // "recoveries", "since_last_s"}. Lock-free (read while a recovery holds the session), so a
  // Python-side hang watchdog can leave a collective's hang to the transparent recovery under way.
  void write_status(JsonWriter& w) const;
  // How long the longest-waiting call of the application has waited for the proxy's answer (an
  // approximation: since the moment no call was waiting); 0 if none is.
  double waiting_for_s() const;
  // The proxy died and that was logged.
  bool proxy_gone() const { return death_reported_.load(std::memory_order_relaxed); }
  // The thread whose channel index is `index` exited: the proxy thread serving its channel ends,
  // the rings are unmapped.
  void close_channel(uint32_t index);

  // Device allocations live now.
  std::vector<ReplayJournal::DeviceRange> device_allocations() const;
  // Where to ask the kernel to map the next pinned buffer of `size` bytes: a range that neither this
  // process nor the proxy uses (both must map it at the same address).
  void* pinned_hint(size_t size);

  void add_memory(uintptr_t base, size_t size, Memory kind);
  bool remove_memory(uintptr_t base, Memory kind, size_t* size = nullptr);
  // The kind of memory [p, p + count) is in (kPageable if it is not all in one known range).
  Memory memory_of(const void* p, size_t count = 1) const;
  bool overlaps_memory(uintptr_t base, size_t size) const;

 private:
  // This thread's channel (opened on its first call), or nullptr with `why` if there is no proxy.
  proxy::ProxyChannel* channel(std::string* why);
  bool start_locked(std::string* why);
  void take_async_report(const proxy::CallResult& r);
  // Kills a proxy that did not answer a watchdog query within `waited`; what to say of it ("" if
  // it was replaced meanwhile).
  std::string kill_hung_proxy(uint64_t generation, uint32_t tag, std::chrono::milliseconds waited);
  // Kills generation `generation`'s proxy (if still the live one) because of `cause`, recorded
  // first: another thread whose call then sees the proxy die must not report that death as the cause.
  void kill_proxy_for(uint64_t generation, const std::string& cause);
  // A failure transparent recovery cannot take (the journal is off, a communicator has peers
  // elsewhere): said once per proxy generation, on stderr and in the event log (issue 16 case 5).
  void refused(uint64_t generation, const std::string& what, const std::string& reason);
  // Why the state of generation `generation`'s failure cannot be rebuilt in this process ("" if it
  // can): the journal, the phase of the failure, the buffers saved or not.
  // `from_replica`: it can, with the buffers of a data-parallel replica (case 3).
  std::string why_not_rebuildable(uint64_t generation, bool* from_replica = nullptr);
  // Why no replica can give this rank its buffers ("" if one can): one communicator with peers (the
  // data-parallel group), the store and a shared directory, and replay validation's word that a
  // replica's buffers stand in for this rank's (replica_check_).
  std::string replica_unavailable() const;
  // A receiver of case 3: the buffers the donor wrote, into save_ (true if there is nothing to take).
  bool take_replica_buffers(std::string* why);
  // The ranks of every communicator with peers elsewhere agree, through the launcher's store, to
  // rebuild it together (each found the failure and can, a rank that lost its buffers with a
  // replica's), or none does and user-level recovery takes over with the proxies still alive
  // (issue 16 case 5). The lowest rank with its buffers gives them to those that lost theirs.
  // Once per generation; "" if all agreed, else why not.
  std::string agree_to_rebuild(uint64_t generation);
  // The word of rank `r` of `c` (waiting until `deadline`), or "new" for a replacement of a dead
  // stage that announced itself in its place (--plugin logging; its nonce in `nonce`).
  bool peer_word(const ReplayJournal::PeerComm& c, int r, std::chrono::steady_clock::time_point deadline,
                 std::string* word, std::string* nonce, std::string* why);
  // A replacement stage's first communicator with peers (stage_join.h): takes the survivors'
  // terms, agrees on the new unique id with them, and returns it (`recorded`: the id to journal,
  // theirs). False with `why` if they did not take it in.
  bool join_survivors(int nranks, int rank, std::string* recorded, std::string* agreed, std::string* why);
  // A rank's word: "yes/<minibatch>" (it can, with its own buffers), "replica/<minibatch>" (with a
  // replica's), or "no: <why>".

  std::string comm_key(const char* what, const std::string& id) const;  // n: the communicator's rebuilds
  static std::string comm_key(const char* what, const std::string& id, uint64_t n);
  // The unique id of a communicator with peers elsewhere in replay validation's scratch proxies.
  bool agree_scratch_id(uint64_t replay, const std::string& recorded_id, int rank, const std::string& fresh,
                        std::string* agreed, std::string* why);
  // After a call of generation `failed_generation` found the proxy lost: replaces it (unless another
  // thread did already) and gives entry `index`'s replayed result. False: the state is lost.
  bool recover(uint64_t failed_generation, int64_t index, const std::string& what, proxy::CallResult* out);
  bool replay_locked(const std::string& what, std::string* why, RecoveryRecord* record);
  // Before a proxy whose communicators failed (its device still works) is replaced: copies the
  // allocations live at the minibatch's start into a memfd, for the new proxy (save_).
  // With the undo plugin, a failure in the optimizer step saves them too, with the inverse launches
  // of the optimizer step's kernels posted before journal id `failed` that had run.
  void save_device(proxy::ProxyChannel* ch, uint64_t generation, ReplayJournal::Phase phase,
                   DeviceBuffers::WaitFor wait = DeviceBuffers::WaitFor::kQueuedWork, int64_t failed = INT64_MAX);
  // After a hang's copies: see recover_from_hang.
  void distrust_save_if_complete(proxy::ProxyChannel* ch, uint64_t generation, cudaEvent_t sentinel);
  // Before a synchronous call on `ch`: what other threads posted without a reply has run in the
  // proxy (see the definition).
  void wait_for_other_threads(proxy::ProxyChannel* ch);
  // recover_now and recover_from_hang: save, kill the old proxy, replace it.
  bool recover_live(const std::string& what, bool hung, bool posted_in_optimizer_step, cudaEvent_t sentinel);
  // Why a failure cannot be recovered here ("" if it can): the journal is off, or cannot be replayed.
  std::string cannot_recover() const;
  // The agreed unique id of a communicator with peers elsewhere (ReplayTarget::rendezvous).
  bool agree_unique_id(const std::string& recorded_id, int rank, const std::string& fresh, std::string* agreed,
                       std::string* why);
  std::chrono::milliseconds peer_wait() const;
  // Replay validation (JIT paper §4.1), at minibatch JITCKPT_VALIDATE_AT (default 5; 0: never) and
  // every JITCKPT_VALIDATE_EVERY after it (default 0: once): the minibatch's start buffers are saved
  // at its mark; before its optimizer step, the journal is replayed into a scratch proxy on top of
  // them and every device buffer compared with the live proxy's. A difference turns transparent
  // recovery off for this process, loudly (stderr, event log), and the program goes on.
  void start_validation();
  void validate();
  // Asks a proxy to stop (or no longer) device work at a failed NCCL call (proxy_server's
  // DeviceState::fenced).
  static bool request_fence(proxy::ProxyChannel* ch, bool on);

  const bool enabled_;
  ProxyKernels kernels_;
  HostRegistrations registrations_;
  UpdateUndo undo_;
  StageJoin join_;
  std::mutex mu_;  // starting the proxy, opening channels
  std::unique_ptr<proxy::ProxyClient> client_;
  std::atomic<uint32_t> next_index_{0};  // channel indices, one per thread that made calls (0: the primary channel)
  IndexedChannels channels_;  // the current proxy's channel of each thread's index
  std::string start_failure_;

  // Calls hold it shared; replacing the proxy holds it exclusively, so no call runs meanwhile.
  std::shared_mutex recovery_mu_;
  std::mutex order_mu_;  // calls whose outcome depends on their order (ReplayJournal::ordered), one at a time
  uint64_t generation_ = 0;  // proxies replaced so far
  ReplayJournal journal_;
  std::map<int64_t, proxy::CallResult> replayed_;  // results of calls that were waiting when the proxy was lost
  uint64_t journal_at_last_recovery_ = UINT64_MAX;

  // The buffers of proxy generation `generation`, saved by save_device.
  struct DeviceSave {
    uint64_t generation = UINT64_MAX;
    ReplayJournal::Phase phase = ReplayJournal::Phase::kUnmarked;  // of the failed call
    bool saved = false;
    std::string failure;  // why not, if it was tried
    DeviceBuffers buffers;
    double seconds = 0;
    std::string from_replica;  // the file they came from, if a replica's
    // A failure in the optimizer step with the undo plugin: the inverse launches that bring the
    // buffers back to the minibatch's start, or why there are none.
    std::vector<UndoLaunch> undo;
    std::string undo_problem;
    bool undoable() const { return phase == ReplayJournal::Phase::kOptimizerStep && saved && undo_problem.empty(); }
  };
  std::mutex save_mu_;
  DeviceSave save_;
  std::atomic<uint64_t> refused_generation_{UINT64_MAX};
  std::mutex kill_cause_mu_;
  std::pair<uint64_t, std::string> kill_cause_{UINT64_MAX, ""};  // a generation whose proxy we killed, and why
  std::atomic<bool> fence_requested_{false};  // asked of the proxy at a minibatch mark
  std::atomic<bool> skip_until_mark_{false};    // case 4: this minibatch's remaining work is the replica's
  std::atomic<int> waiting_{0};                 // application calls waiting for an answer
  std::atomic<int64_t> waiting_since_ns_{0};    // steady clock, when waiting_ last left 0
  std::atomic<int> recovering_{0};              // threads between a failure found and its recovery's end
  std::atomic<uint64_t> recoveries_{0};
  std::atomic<int64_t> last_recovery_ns_{0};    // steady clock, when the last one ended
  const RendezvousStore store_;  // the launcher's, for communicators with peers elsewhere
  const std::string replica_dir_;  // JITCKPT_REPLICA_DIR: where replicas leave buffers for each other
  // "" once replay validation found a replica's buffers of a minibatch's start give this rank's
  // results; else why not (under recovery_mu_).
  std::string replica_check_ =
      "no replay validation has checked yet that a replica's buffers stand in for this rank's (JITCKPT_VALIDATE_AT)";
  std::map<std::string, uint64_t> comm_rebuilds_;  // unique id -> rebuilds so far (under recovery_mu_)
  std::mutex vote_mu_;
  struct Vote {
    uint64_t generation = UINT64_MAX;
    std::string verdict;
    double seconds = 0;
    std::string replica_key;  // a receiver's: where the donor names its file
    bool skip_minibatch = false;  // a receiver's: the replica finished this minibatch (case 4)
  };
  Vote vote_;  // a generation's agree_to_rebuild

  const uint64_t validate_at_, validate_every_;
  std::atomic<uint64_t> minibatches_{0};  // minibatch marks so far (read by the recovery's vote)
  DeviceBuffers validation_start_;             // the buffers of the validated minibatch's start
  uint64_t validation_mark_ = UINT64_MAX;      // its first call
  std::string lost_;  // why the device state is gone for good ("" while it is not)
  std::atomic<bool> death_reported_{false};
  std::atomic<uint64_t> tokens_{0};

  mutable std::mutex memory_mu_;
  uintptr_t next_pinned_ = 0x5000'0000'0000;  // below where PIE executables, heaps and libraries go
  struct Range {
    size_t size;
    Memory kind;
  };
  std::map<uintptr_t, Range> memory_;
};

}  // namespace jitckpt
