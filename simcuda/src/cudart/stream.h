// A simulated CUDA stream: an in-order queue of operations run asynchronously by one worker thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "error_state.h"

namespace simcuda {

class Stream : public std::enable_shared_from_this<Stream> {
 public:
  enum class Kind { Legacy, PerThread, User };
  using Op = std::function<void()>;

  // Starts the worker thread. The worker is detached and keeps the stream alive until close() and the
  // queue has drained, so a hung stream never blocks process exit (no joins in destructors).
  // `errors` decides whether ops still run: after a sticky fault the device executes nothing more.
  static std::shared_ptr<Stream> create(int device, Kind kind, unsigned flags, int priority,
                                        const ErrorState* errors);

  // Appends `op`; returns its sequence number (1-based, increasing). Once the context has a sticky
  // error, ops are skipped (they still count as completed) unless `always_run`.
  uint64_t enqueue(Op op, bool always_run = false);
  // Sequence number of the most recently enqueued op (0 if none).
  uint64_t last_enqueued() const;
  // True once ops up to and including `seq` have finished.
  bool reached(uint64_t seq) const;
  // Blocks the calling thread until reached(seq). Never times out: a hung op hangs the waiter too.
  void wait_until(uint64_t seq) const;
  // No further ops will be enqueued; the worker exits after the queue drains.
  void close();

  int device() const { return device_; }
  Kind kind() const { return kind_; }
  unsigned flags() const { return flags_; }
  int priority() const { return priority_; }
  // Blocking streams implicitly synchronize with the legacy default stream (cudaStreamNonBlocking unset).
  bool blocking() const;

 private:
  Stream(int device, Kind kind, unsigned flags, int priority, const ErrorState* errors)
      : device_(device), kind_(kind), flags_(flags), priority_(priority), errors_(errors) {}

  struct Item {
    uint64_t seq;
    Op op;
    bool always_run;
  };
  void run();

  const int device_;
  const Kind kind_;
  const unsigned flags_;
  const int priority_;
  const ErrorState* errors_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::deque<Item> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  bool closed_ = false;
};

}  // namespace simcuda
