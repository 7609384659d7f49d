#include "stream.h"

#include <cuda_runtime_api.h>

#include <thread>

namespace simcuda {

std::shared_ptr<Stream> Stream::create(int device, Kind kind, unsigned flags, int priority,
                                       const ErrorState* errors) {
  std::shared_ptr<Stream> s(new Stream(device, kind, flags, priority, errors));
  std::thread([s] { s->run(); }).detach();
  return s;
}

bool Stream::blocking() const { return (flags_ & cudaStreamNonBlocking) == 0; }

uint64_t Stream::enqueue(Op op, bool always_run) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = ++enqueued_;
  queue_.push_back(Item{seq, std::move(op), always_run});
  cv_.notify_all();
  return seq;
}

uint64_t Stream::last_enqueued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enqueued_;
}

bool Stream::reached(uint64_t seq) const {
  std::lock_guard<std::mutex> lock(mu_);
  return completed_ >= seq;
}

void Stream::wait_until(uint64_t seq) const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return completed_ >= seq; });
}

void Stream::close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  cv_.notify_all();
}

void Stream::run() {
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !queue_.empty() || closed_; });
      if (queue_.empty()) return;  // closed and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    if (item.always_run || errors_->sticky() == cudaSuccess) item.op();
    {
      std::lock_guard<std::mutex> lock(mu_);
      completed_ = item.seq;
    }
    cv_.notify_all();
  }
}

}  // namespace simcuda
