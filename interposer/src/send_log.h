// SWIFT logging of point-to-point traffic at the NCCL level (issue 4, the "NCCL send" hook):
// every ncclSend's payload is copied to pinned host memory on the send's own stream, right after
// the send in stream order, so the copy holds exactly the bytes sent whatever the application
// writes into the buffer later, and the calling thread never waits for it. A writer thread waits
// for each copy's event and writes the records in chunk files of the format the Python side
// reads (jitckpt/swift/pipeline/logging_records.py: kind "send", (iteration, micro-batch, payload, src,
// dst, seq, generation)), so a replacement stage replays NCCL-logged inputs with the same tools.
//
// Off unless $JITCKPT_SEND_LOG_DIR is set. What a send carries comes from LogContext.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "log_chunk.h"
#include "log_context.h"

namespace jitckpt {

class JsonWriter;

class SendLog {
 public:
  SendLog();  // reads $JITCKPT_SEND_LOG_DIR, $JITCKPT_SEND_LOG_CHUNK, $JITCKPT_GEN
  SendLog(const SendLog&) = delete;
  SendLog& operator=(const SendLog&) = delete;

  bool enabled() const { return !dir_.empty(); }
  // Before the ncclSend of `count` elements from `buf` to `peer` on `stream`, carrying `ctx`.
  void on_send(const LogContext::Value& ctx, const void* buf, size_t count, ncclDataType_t dtype, int peer,
               ncclComm_t comm, cudaStream_t stream);
  // Waits (at most timeout_s) until every send logged so far is written, a partial chunk
  // included. Returns false with the reason in `error` on a timeout (a copy waits behind a blocked
  // stream; every completed one is written by then) or after a failed copy or write (logging
  // stops at the first failure). libjit.so flushes on every detected failure, before the handler.
  bool flush(double timeout_s, std::string* error);
  // Deletes chunk files whose records are all from iterations <= `iteration` (the newest global
  // checkpoint covers them). Returns how many files were deleted.
  int drop_through(int64_t iteration);
  void write_status(JsonWriter& w) const;  // the "send_log" object of status()

 private:
  struct Pending {
    RecordMeta meta;
    size_t count = 0;             // elements
    size_t nbytes = 0;
    void* host = nullptr;         // pinned, capacity >= nbytes
    size_t capacity = 0;
    cudaEvent_t done = nullptr;   // recorded after the copy
  };

  void writer_loop();
  bool write_records(std::vector<Pending>& records, std::string* error);
  // A pinned buffer of at least nbytes and an event, pooled (mu_ not held: may allocate).
  bool take_resources(Pending* p);
  void give_back(Pending* p);                           // mu_ held
  void start_writer();                                  // mu_ held
  void fail(const std::string& why);                    // mu_ held

  std::string dir_;
  size_t chunk_records_ = 64;
  int generation_ = 0;

  mutable std::mutex mu_;
  std::condition_variable wake_;        // writer: work or a flush request
  std::condition_variable written_;     // flushers: progress
  std::deque<Pending> queue_;
  std::vector<Pending> chunk_;          // copied, not yet in a file
  std::map<int, int64_t> next_seq_;     // per destination rank
  std::multimap<size_t, void*> free_;   // pinned buffers by capacity
  std::vector<cudaEvent_t> free_events_;
  int64_t queued_ = 0, written_count_ = 0, files_ = 0, bytes_ = 0;
  int64_t flush_requests_ = 0, flushes_done_ = 0;
  std::string error_;
  std::unique_ptr<std::thread> writer_;
};

}  // namespace jitckpt
