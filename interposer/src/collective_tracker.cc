#include "collective_tracker.h"

#include <algorithm>

#include "diagnostics.h"
#include "real_api.h"

namespace jitckpt {
namespace {

// Collectives issued inside ncclGroupStart/End by this thread, recorded at the outermost GroupEnd.
struct GroupState {
  int depth = 0;
  std::vector<uint64_t> pending;
};
thread_local GroupState tls_group;

int current_device() {
  int dev = 0;
  if (auto get = real_cuda.getDevice.get()) get(&dev);
  return dev;
}

}  // namespace

uint64_t CollectiveTracker::begin_call(const char* op, ncclComm_t comm, cudaStream_t stream, int64_t step,
                                       std::string phase) {
  CollectiveRecord rec;
  rec.op = op;
  rec.comm = comm;
  rec.stream = stream;
  rec.device = current_device();
  rec.step = step;
  rec.phase = std::move(phase);
  rec.since = Clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  rec.seq = next_seq_++;
  if (first_device_ < 0) first_device_ = rec.device;
  in_flight_.push_back(std::move(rec));
  return in_flight_.back().seq;
}

void CollectiveTracker::end_call(uint64_t seq, bool enqueued) {
  if (enqueued && tls_group.depth > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& r : in_flight_)
      if (r.seq == seq) r.in_host_call = false;  // queued in the group; the clock keeps running
    tls_group.pending.push_back(seq);
    return;
  }
  if (enqueued) {
    record_sentinel(seq);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);  // the call failed: nothing to wait for on the device
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                  [&](const CollectiveRecord& r) { return r.seq == seq; }),
                   in_flight_.end());
}

void CollectiveTracker::group_start() { ++tls_group.depth; }

void CollectiveTracker::group_end(bool enqueued) {
  if (tls_group.depth > 0) --tls_group.depth;
  if (tls_group.depth > 0) return;
  std::vector<uint64_t> pending;
  pending.swap(tls_group.pending);
  for (uint64_t seq : pending) {
    if (enqueued) {
      record_sentinel(seq);
    } else {
      end_call(seq, false);
    }
  }
}

cudaEvent_t CollectiveTracker::take_event(int device) {
  uint64_t oldest = 0;
  cudaEvent_t candidate = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = free_events_.begin(); it != free_events_.end(); ++it) {
      if (it->first == device) {
        cudaEvent_t e = it->second;
        free_events_.erase(it);
        return e;
      }
    }
    for (const auto& r : in_flight_)
      if (r.device == device && r.sentinel != nullptr) {
        oldest = r.seq;
        candidate = r.sentinel;
        break;
      }
  }
  // The pool is empty until the watchdog's next poll retires what finished. Collectives faster than
  // its polls would grow it by an event each (in proxy mode, each a call the replay journal keeps):
  // the oldest collective, if done, is retired here and its event taken instead.
  auto query = real_cuda.eventQuery.get();
  if (candidate != nullptr && query != nullptr && query(candidate) == cudaSuccess) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(in_flight_.begin(), in_flight_.end(),
                           [&](const CollectiveRecord& r) { return r.seq == oldest && r.sentinel == candidate; });
    if (it != in_flight_.end()) {
      in_flight_.erase(it);
      ++completed_;
      return candidate;
    }
  }
  cudaEvent_t e = nullptr;
  auto create = real_cuda.eventCreateWithFlags.get();
  if (create == nullptr || create(&e, cudaEventDisableTiming) != cudaSuccess) return nullptr;
  return e;
}

void CollectiveTracker::record_sentinel(uint64_t seq) {
  cudaStream_t stream = nullptr;
  int device = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(in_flight_.begin(), in_flight_.end(),
                           [&](const CollectiveRecord& r) { return r.seq == seq; });
    if (it == in_flight_.end()) return;
    stream = it->stream;
    device = it->device;
  }
  // This runs on the thread that issued the collective, so the current device is the stream's.
  cudaEvent_t e = take_event(device);
  auto record = real_cuda.eventRecord.get();
  bool recorded = e != nullptr && record != nullptr && record(e, stream) == cudaSuccess;
  if (!recorded) log_verbose("could not record a sentinel event after collective %llu",
                             static_cast<unsigned long long>(seq));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& r : in_flight_) {
    if (r.seq != seq) continue;
    r.in_host_call = false;
    r.since = Clock::now();
    r.sentinel = recorded ? e : nullptr;
  }
  if (!recorded) {
    // Without a sentinel the collective cannot be watched; drop it rather than report a false hang.
    in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                    [&](const CollectiveRecord& r) { return r.seq == seq; }),
                     in_flight_.end());
    if (e != nullptr) free_events_.emplace_back(device, e);
  }
}

std::vector<CollectiveRecord> CollectiveTracker::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_flight_;
}

void CollectiveTracker::retire(const std::vector<uint64_t>& seqs) {
  if (seqs.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto done = [&](const CollectiveRecord& r) {
    return std::find(seqs.begin(), seqs.end(), r.seq) != seqs.end();
  };
  for (const auto& r : in_flight_) {
    if (!done(r)) continue;
    if (r.sentinel != nullptr) free_events_.emplace_back(r.device, r.sentinel);
    ++completed_;
  }
  in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(), done), in_flight_.end());
}

void CollectiveTracker::restart_clocks() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  for (auto& r : in_flight_) r.since = now;
}

uint64_t CollectiveTracker::completed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_;
}

int CollectiveTracker::first_device() const {
  std::lock_guard<std::mutex> lock(mu_);
  return first_device_;
}

void CollectiveTracker::add_comm(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(comms_mu_);
  if (std::find(comms_.begin(), comms_.end(), comm) == comms_.end()) comms_.push_back(comm);
}

void CollectiveTracker::remove_comm(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(comms_mu_);
  comms_.erase(std::remove(comms_.begin(), comms_.end(), comm), comms_.end());
}

size_t CollectiveTracker::comm_count() const {
  std::lock_guard<std::mutex> lock(comms_mu_);
  return comms_.size();
}

void CollectiveTracker::poll_comms(const std::function<void(ncclComm_t)>& fn) {
  std::lock_guard<std::mutex> lock(comms_mu_);
  for (ncclComm_t c : comms_) fn(c);
}

}  // namespace jitckpt
