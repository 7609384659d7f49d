#include "send_log.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "json_writer.h"
#include "real_api.h"

namespace jitckpt {

namespace {

size_t round_up_pow2(size_t n) {
  size_t c = 4096;
  while (c < n) c <<= 1;
  return c;
}

}  // namespace

SendLog::SendLog() {
  const char* dir = std::getenv("JITCKPT_SEND_LOG_DIR");
  if (dir == nullptr || *dir == '\0') return;
  dir_ = dir;
  if (const char* c = std::getenv("JITCKPT_SEND_LOG_CHUNK")) chunk_records_ = std::max(1L, std::atol(c));
  if (const char* g = std::getenv("JITCKPT_GEN")) generation_ = std::atoi(g);
  // A restarted process appends after the chunks already there (names must stay unique).
  for (const ChunkFile& c : list_chunks(dir_)) files_ = std::max<int64_t>(files_, c.number + 1);
}

void SendLog::fail(const std::string& why) {
  if (error_.empty()) {
    error_ = why;
    std::fprintf(stderr, "[libjit] send log disabled: %s\n", why.c_str());
  }
  written_.notify_all();
}

bool SendLog::take_resources(Pending* p) {
  const size_t want = std::max<size_t>(p->nbytes, 1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = free_.lower_bound(want);
    if (it != free_.end() && it->first <= 2 * round_up_pow2(want)) {
      p->host = it->second;
      p->capacity = it->first;
      free_.erase(it);
    }
    if (!free_events_.empty()) {
      p->done = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (p->host == nullptr) {
    p->capacity = round_up_pow2(want);
    auto alloc = real_cuda.mallocHost.get();
    if (alloc == nullptr || alloc(&p->host, p->capacity) != cudaSuccess) p->host = nullptr;
  }
  if (p->done == nullptr) {
    auto create = real_cuda.eventCreateWithFlags.get();
    if (create == nullptr || create(&p->done, cudaEventDisableTiming) != cudaSuccess) p->done = nullptr;
  }
  return p->host != nullptr && p->done != nullptr;
}

void SendLog::give_back(Pending* p) {
  if (p->host != nullptr) free_.emplace(p->capacity, p->host);
  if (p->done != nullptr) free_events_.push_back(p->done);
  p->host = nullptr;
  p->done = nullptr;
}

void SendLog::start_writer() {
  if (!writer_) writer_ = std::make_unique<std::thread>([this] { writer_loop(); });
}

void SendLog::on_send(const LogContext::Value& ctx, const void* buf, size_t count, ncclDataType_t dtype,
                      int peer, ncclComm_t comm, cudaStream_t stream) {
  // mu_ guards bookkeeping only; no CUDA call is made under it (an application thread may block in
  // one, and flush() must still honour its deadline).
  size_t elem = 0;
  const char* name = torch_dtype(dtype, &elem);
  int src = -1;
  auto user_rank = real_nccl.commUserRank.get();
  if (user_rank != nullptr) user_rank(comm, &src);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  auto capturing = real_cuda.streamIsCapturing.get();
  if (capturing != nullptr) capturing(stream, &capture);
  Pending p;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return;
    if (name == nullptr) return fail("ncclSend with an unknown datatype " + std::to_string(static_cast<int>(dtype)));
    if (capture != cudaStreamCaptureStatusNone)
      return fail("an ncclSend was captured into a CUDA graph: the log cannot follow graph replays");
    p.meta = RecordMeta{ctx.iteration, ctx.micro_batch, ctx.payload, src, peer, next_seq_[peer]++, generation_,
                        "send", name};
  }
  p.count = count;
  p.nbytes = count * elem;
  auto copy = real_cuda.memcpyAsync.get();
  auto record = real_cuda.eventRecord.get();
  std::string why;
  if (!take_resources(&p)) {
    why = "cannot allocate " + std::to_string(p.nbytes) + " bytes of pinned memory or a CUDA event";
  } else if (copy == nullptr || record == nullptr ||
             (p.nbytes > 0 && copy(p.host, buf, p.nbytes, cudaMemcpyDeviceToHost, stream) != cudaSuccess) ||
             record(p.done, stream) != cudaSuccess) {
    // Enqueued before the send itself: a send that never completes (its receiver died) must
    // still be logged, since the receiver's replacement will need exactly this message.
    why = "the device-to-host copy of a send could not be enqueued";
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!why.empty()) {
    give_back(&p);
    return fail(why);
  }
  queue_.push_back(std::move(p));
  ++queued_;
  start_writer();
  wake_.notify_one();
}

void SendLog::writer_loop() {
  auto query = real_cuda.eventQuery.get();
  auto idle = std::chrono::microseconds(200);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [this] { return !queue_.empty() || flush_requests_ > flushes_done_; });
    // Every copy that has completed is taken, in queue order, not only the oldest: a copy stuck
    // behind a blocked stream must not hold back the messages of other streams. Events are
    // polled (never cudaEventSynchronize), so flush() keeps its deadline.
    // A flush asked for before this pass's queries: every copy the application waited for before
    // it asked shows as done in them, so only copies still running are left for a later chunk.
    // One asked for meanwhile is served by the next pass.
    const int64_t flush_seen = flush_requests_;
    std::deque<Pending> batch;
    batch.swap(queue_);
    lock.unlock();
    std::vector<Pending> ready, failed;
    std::deque<Pending> waiting;
    for (Pending& p : batch) {
      cudaError_t st = query(p.done);
      if (st == cudaErrorNotReady) {
        waiting.push_back(std::move(p));
      } else {
        (st == cudaSuccess ? ready : failed).push_back(std::move(p));
      }
    }
    lock.lock();
    while (!waiting.empty()) {  // back in front of whatever was queued meanwhile, in order
      queue_.push_front(std::move(waiting.back()));
      waiting.pop_back();
    }
    for (Pending& p : failed) give_back(&p);
    if (!failed.empty()) fail("a send's device-to-host copy failed");
    for (Pending& p : ready) chunk_.push_back(std::move(p));
    const bool flushing = flush_seen > flushes_done_;
    while (chunk_.size() >= chunk_records_ || (flushing && !chunk_.empty())) {
      size_t n = std::min(chunk_.size(), chunk_records_);
      std::vector<Pending> records(std::make_move_iterator(chunk_.begin()),
                                   std::make_move_iterator(chunk_.begin() + static_cast<long>(n)));
      chunk_.erase(chunk_.begin(), chunk_.begin() + static_cast<long>(n));
      lock.unlock();
      std::string error;
      bool ok = write_records(records, &error);
      lock.lock();
      for (Pending& r : records) give_back(&r);
      if (!ok) fail(error);
      written_.notify_all();
    }
    if (flushing && queue_.empty() && chunk_.empty()) {
      flushes_done_ = flush_seen;
      written_.notify_all();
    }
    if (!queue_.empty() && ready.empty()) {  // copies still running: back off, up to 10 ms
      lock.unlock();
      std::this_thread::sleep_for(idle);
      idle = std::min(idle * 2, std::chrono::microseconds(10000));
      lock.lock();
    } else {
      idle = std::chrono::microseconds(200);
    }
  }
}

bool SendLog::write_records(std::vector<Pending>& records, std::string* error) {
  std::vector<ChunkEntry> entries;
  uint64_t bytes = 0;
  for (const Pending& p : records) {
    entries.push_back(ChunkEntry{&p.meta, p.host, p.nbytes, p.count});
    bytes += p.nbytes;
  }
  int64_t number;
  {
    std::lock_guard<std::mutex> lock(mu_);
    number = files_++;
  }
  if (!write_chunk(dir_, generation_, number, entries, error)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  written_count_ += static_cast<int64_t>(records.size());
  bytes_ += static_cast<int64_t>(bytes);
  return true;
}

bool SendLog::flush(double timeout_s, std::string* error) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!enabled()) return true;
  int64_t ticket = ++flush_requests_;
  start_writer();
  wake_.notify_one();
  bool done = written_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                [&] { return flushes_done_ >= ticket || !error_.empty(); });
  if (!error_.empty()) {
    *error = error_;
    return false;
  }
  if (!done) {
    *error = std::to_string(queue_.size()) + " logged sends still wait for their device-to-host copy after " +
             std::to_string(timeout_s) + " s (a stream is blocked); every completed one is written";
    return false;
  }
  return true;
}

int SendLog::drop_through(int64_t iteration) {
  if (!enabled()) return 0;
  int dropped = 0;
  for (const ChunkFile& c : list_chunks(dir_))
    if (c.hi <= iteration) dropped += std::remove((dir_ + "/" + c.name).c_str()) == 0;
  return dropped;
}

void SendLog::write_status(JsonWriter& w) const {
  std::lock_guard<std::mutex> lock(mu_);
  w.begin_object();
  w.key("enabled").value(enabled());
  w.key("dir").value(dir_);
  w.key("queued").value(queued_);
  w.key("written").value(written_count_);
  w.key("files").value(files_);
  w.key("bytes").value(bytes_);
  w.key("error").value(error_);
  w.end_object();
}

}  // namespace jitckpt
