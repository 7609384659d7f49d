// Proxy mode's replay journal (issue 16): every request this process sent to its device proxy, in
// the order the calls were made, with what a new proxy needs to redo them: the memfds handed over
// (pinned buffers, registered pages, modules; kept open here) and the bytes of pinned sources as
// they were at the call. When the proxy dies, or its device gets a sticky error, ProxySession
// starts a new proxy and replays the journal into it, so the device state the application holds
// (pointers, virtual handles, contents) is rebuilt and the application sees only a pause.
//
// Without minibatch marks the journal holds every call since the first one. At each minibatch mark
// (jitckpt_mark_minibatch(), or PyTorch's optimizer hooks through the Python runtime) it drops the
// device work of the minibatch that ended (launches, copies, memsets, collectives, event records)
// and keeps what built the state the application holds (allocations, streams, events, modules,
// communicators, settings): a replay then rebuilds the objects, the caller puts the buffers' contents
// back, and only the current minibatch's work runs again. A byte limit (JITCKPT_REPLAY_LIMIT_MB)
// bounds it: past it the journal is dropped and a lost proxy is a failure again, said once on
// stderr. Thread-safe: calls append from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "proxy_client.h"

namespace jitckpt {

class ReplayJournal {
 public:
  // A copy whose source is host memory the proxy shares (pinned or registered): replayed from the
  // bytes the source held at the call, since the application may have rewritten them since.
  struct HostSource {
    uint64_t dst;
    uint64_t stream;
    bool async;
  };
  struct Entry {
    uint64_t id;  // the call's number in this process (ids only grow; a mark drops some)
    uint32_t tag;
    uint32_t channel;  // the index of the calling thread's channel (0: the first thread's)
    uint64_t seq;      // its request's number on that channel
    bool no_reply;
    bool completed = false;  // the application has its reply
    int32_t status = 0;      // the status it got
    bool has_source = false;
    HostSource source{};
    size_t offset = 0, size = 0;  // the request (or, with a source, the copied bytes) in the byte store
    int fd = -1;                  // a duplicate of the memfd handed over with the request
    uint64_t fd_token = 0;
    std::vector<uint8_t> results;  // of a call that creates what the application holds, as it got them
  };

  explicit ReplayJournal(size_t limit_bytes);
  ~ReplayJournal();
  ReplayJournal(const ReplayJournal&) = delete;
  ReplayJournal& operator=(const ReplayJournal&) = delete;

  // Where the current minibatch is (see mark_minibatch).
  enum class Phase { kUnmarked, kMinibatch, kOptimizerStep };
  struct DeviceRange {
    uint64_t base, size;
  };

  // Records a request about to be sent; its id, or -1 when the journal is off. `source`: replay
  // it as an inline copy of the `source_bytes` instead of `payload`.
  int64_t append(uint32_t tag, uint32_t channel, uint64_t seq, bool no_reply, const uint8_t* payload, size_t size, int fd,
                 uint64_t fd_token, const HostSource* source = nullptr, const void* source_bytes = nullptr,
                 size_t source_size = 0);
  // The application got `r` for the call with id `id`.
  void completed(int64_t id, const proxy::CallResult& r);

  // A minibatch starts: drops the ended minibatch's device work (see above) and remembers the device
  // allocations live now, whose contents a replay must put back before the minibatch's calls.
  void mark_minibatch(std::vector<DeviceRange> live_allocations);
  // The optimizer step starts: from here to the next mark, parameters and optimizer state change.
  void mark_optimizer_step();
  Phase phase() const;
  // The phase the call with this id was made in (the current one if the id is unknown).
  Phase phase_of(int64_t id) const;
  // The id of the request `seq` of channel `channel` with this tag, or -1.
  int64_t find(uint32_t channel, uint64_t seq, uint32_t tag) const;
  // The same on any channel (the newest match): a fenced proxy reports a failed call on whichever
  // channel replies next, not only on the failed call's own.
  int64_t find_any_channel(uint64_t seq, uint32_t tag) const;
  // The device allocations live when the current minibatch started.
  std::vector<DeviceRange> allocations_at_mark() const;
  // The request of the call with this id as it was sent, and its channel index; false if the
  // journal does not hold it.
  bool request(int64_t id, std::vector<uint8_t>* bytes, uint32_t* channel) const;

  bool on() const;
  // Drops the journal for good, saying why on stderr.
  void turn_off(const std::string& why);
  std::string off_reason() const;
  // Whether a new proxy can rebuild the state: a communicator with peers in other processes is
  // rebuilt with them through the launcher's store (`peers_reachable`), and not at all if this
  // process holds several of its ranks (one replay thread would wait for itself). Empty, or why not.
  std::string cannot_replay(bool peers_reachable) const;
  // Whether a communicator has peers in other processes.
  bool has_peers() const;
  struct PeerComm {
    std::string id;  // the unique id it was made with
    int rank = 0, nranks = 0;
  };
  // The communicators with peers in other processes (this process's rank in each).
  std::vector<PeerComm> peer_comms() const;

  // Under the caller's guarantee that nobody appends meanwhile (ProxySession's recovery lock).
  size_t size() const { return entries_.size(); }
  uint64_t next_id() const {
    std::lock_guard<std::mutex> lock(mu_);
    return next_id_;
  }
  // The first call of the current minibatch.
  uint64_t minibatch_start() const { return mark_id_; }
  const Entry& entry(size_t i) const { return entries_[i]; }
  const uint8_t* bytes(const Entry& e) const { return bytes_.data() + e.offset; }
  size_t total_bytes() const { return bytes_.size(); }

  // Whether a call with this tag hands the application something it keeps (a device pointer, a
  // virtual handle, a kernel or module id), which a replay must reproduce exactly.
  static bool creates(uint32_t tag);
  // Whether a call's outcome depends on the order of such calls across threads (the runtime's
  // first-fit allocator, the proxy's handle numbering): CUDA calls that create or free. ProxySession
  // makes them one at a time, so the journal's order is the order they ran in. NCCL's are not
  // (threads of one process initialize communicators together, each waiting for the others).
  static bool ordered(uint32_t tag);
  // Device work whose effect on the buffers is all there is to it (a launch, a copy into the device,
  // a collective, an event record): a minibatch mark drops the ended minibatch's. Everything else
  // (an unknown call too) is kept.
  static bool work(uint32_t tag);
  // Whether a call leaves device state as it found it (queries, synchronizes, copies to the host):
  // it is not journaled; one that was waiting when the proxy was lost is made again on the new one.
  static bool stateless(uint32_t tag);
  // ncclGetUniqueId (its results are kept: a replay maps the old id to the new one), and whether a
  // call makes a communicator from a unique id: ncclCommInitRank and ncclCommInitRankConfig
  // (ProcessGroupNCCL's), whose requests begin alike (head, the communicator's presence byte,
  // nranks, the id, rank; the config follows). A communicator split from one is made with its
  // parent's peers: the parent is the journal's communicator with peers.
  static uint32_t unique_id_tag();
  static bool inits_comm_from_id(uint32_t tag);
  static constexpr size_t kCommIdOffset = 16 + 1 + 4;
  static constexpr size_t kCommRankOffset = kCommIdOffset + 128;  // sizeof(ncclUniqueId)

 private:
  void turn_off_locked(const std::string& why);
  void compact_locked();

  const size_t limit_;
  mutable std::mutex mu_;
  std::vector<Entry> entries_;
  std::vector<uint8_t> bytes_;
  std::string off_;
  std::map<std::string, int> multi_rank_comms_;  // unique id -> this process's ranks in it
  std::vector<PeerComm> peer_comms_;
  uint64_t next_id_ = 0;
  Phase phase_ = Phase::kUnmarked;
  uint64_t mark_id_ = 0;
  uint64_t optimizer_id_ = 0;  // the first call of the optimizer step (phase_ kOptimizerStep)
  std::vector<DeviceRange> mark_allocations_;
};

}  // namespace jitckpt
