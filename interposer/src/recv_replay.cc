#include "recv_replay.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "json_writer.h"
#include "log_chunk.h"
#include "real_api.h"
#include "recovery_event.h"

namespace jitckpt {

RecvReplay::RecvReplay() {
  const char* dirs = std::getenv("JITCKPT_RECV_REPLAY_DIRS");
  const char* through = std::getenv("JITCKPT_RECV_REPLAY_THROUGH");
  const char* join = std::getenv("JITCKPT_STAGE_JOIN");
  const bool joins = join != nullptr && std::strcmp(join, "1") == 0;  // the survivors say how far
  if (dirs == nullptr || *dirs == '\0' || ((through == nullptr || *through == '\0') && !joins)) return;
  std::string all = dirs;
  for (size_t start = 0; start <= all.size();) {
    size_t end = all.find(':', start);
    if (end == std::string::npos) end = all.size();
    if (end > start) dirs_.push_back(all.substr(start, end - start));
    start = end + 1;
  }
  through_ = through != nullptr && *through != '\0' ? std::atoll(through) : -1;
  enabled_ = !dirs_.empty();
}

ncclResult_t RecvReplay::fail(const std::string& why) {
  if (error_.empty()) error_ = why;
  std::fprintf(stderr, "[libjit] receive replay: %s\n", why.c_str());
  return ncclInvalidUsage;
}

bool RecvReplay::load() {
  if (loaded_) return error_.empty();
  loaded_ = true;
  for (const std::string& dir : dirs_) {
    for (const ChunkFile& c : list_chunks(dir)) {
      if (c.lo > through_.load()) continue;  // nothing this replay will ask for
      std::vector<ChunkRecord> records;
      std::string why;
      if (!read_chunk(dir + "/" + c.name, &records, &why)) {
        fail("cannot use the log: " + why);
        return false;
      }
      for (ChunkRecord& r : records) {
        const RecordMeta& m = r.meta;
        if (m.kind != "send" || m.iteration > through_.load()) continue;
        Key key{m.iteration, m.micro_batch, m.payload, m.src, m.dst};
        auto it = messages_.find(key);
        // Re-sent after an earlier recovery: the newest generation's copy wins (as LogIndex).
        if (it != messages_.end() && it->second.generation > m.generation) continue;
        messages_[key] = Message{m.generation, m.seq, m.dtype, std::move(r.bytes)};
      }
    }
  }
  return true;
}

ncclResult_t RecvReplay::serve(const LogContext::Value& ctx, void* buf, size_t count, ncclDataType_t dtype,
                               int peer, ncclComm_t comm, cudaStream_t stream) {
  int me = -1;
  auto user_rank = real_nccl.commUserRank.get();
  if (user_rank != nullptr) user_rank(comm, &me);
  size_t elem = 0;
  const char* name = torch_dtype(dtype, &elem);
  std::unique_lock<std::mutex> lock(mu_);
  if (!load()) return ncclInvalidUsage;
  char what[256];
  std::snprintf(what, sizeof what, "(iteration %lld, micro-batch %d, %s, from rank %d to rank %d)",
                static_cast<long long>(ctx.iteration), ctx.micro_batch, ctx.payload.c_str(), peer, me);
  auto it = messages_.find(Key{ctx.iteration, ctx.micro_batch, ctx.payload, peer, me});
  if (it == messages_.end())
    return fail(std::string("no logged message ") + what + " in the neighbours' logs (flushed before the "
                "failure? dropped by a newer global checkpoint than the one loaded?)");
  const Message& m = it->second;
  if (name == nullptr || m.dtype != name || m.bytes.size() != count * elem)
    return fail(std::string("logged message ") + what + " is " + std::to_string(m.bytes.size()) + " bytes of " +
                m.dtype + ", the receive asks for " + std::to_string(count) + " x " + (name ? name : "?"));
  auto last = last_taken_.find(peer);
  std::pair<int, int64_t> order{m.generation, m.seq};
  if (last != last_taken_.end() && order <= last->second)
    return fail(std::string("replay asked for ") + what + " out of its sender's original order: the replayed "
                "stage diverged from the run that wrote the log");
  last_taken_[peer] = order;
  if (served_++ == 0) first_served_ = ctx.iteration;
  // messages_ no longer changes once loaded: the bytes stay where they are after the unlock.
  const void* src = m.bytes.data();
  size_t nbytes = m.bytes.size();
  lock.unlock();  // a pageable copy may wait for staging buffers: never under mu_
  auto copy = real_cuda.memcpyAsync.get();
  if (copy == nullptr || copy(buf, src, nbytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
    lock.lock();
    return fail(std::string("cannot enqueue the copy of ") + what);
  }
  return ncclSuccess;
}

void RecvReplay::went_live(const LogContext::Value& ctx) {
  if (!enabled_ || live_.load(std::memory_order_relaxed) || live_.exchange(true)) return;
  int64_t first, served;
  {
    std::lock_guard<std::mutex> lock(mu_);
    first = first_served_ < 0 ? ctx.iteration : first_served_;
    served = served_;
  }
  const int64_t through = through_.load();
  std::fprintf(stderr, "[libjit] receive replay: caught up at iteration %lld (%lld message(s) replayed from the "
               "logs, iterations %lld..%lld)\n", static_cast<long long>(ctx.iteration), static_cast<long long>(served),
               static_cast<long long>(first), static_cast<long long>(through));
  append_stage_caught_up(first - 1, through - first + 1);
}

void RecvReplay::dropped_send() {
  std::lock_guard<std::mutex> lock(mu_);
  ++dropped_sends_;
}

void RecvReplay::write_status(JsonWriter& w) const {
  std::lock_guard<std::mutex> lock(mu_);
  w.begin_object();
  w.key("enabled").value(enabled_);
  w.key("through").value(through_.load());
  w.key("served").value(served_);
  w.key("dropped_sends").value(dropped_sends_);
  w.key("error").value(error_);
  w.end_object();
}

}  // namespace jitckpt
