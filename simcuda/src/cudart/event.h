// A simulated CUDA event: a marker op recorded into a stream that timestamps itself when it runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "stream.h"

namespace simcuda {

// One recording of an event: the stream position it waits for and the time the stream got there.
struct EventMarker {
  std::shared_ptr<Stream> stream;
  uint64_t seq = 0;
  std::mutex mu;
  std::optional<std::chrono::steady_clock::time_point> at;

  bool complete() const { return stream->reached(seq); }
};

class Event {
 public:
  Event(int device, unsigned flags) : device_(device), flags_(flags) {}
  int device() const { return device_; }
  unsigned flags() const { return flags_; }
  bool timing_disabled() const;
  // Replaces the current recording (cudaEventRecord semantics: later queries refer to the new one).
  void set_marker(std::shared_ptr<EventMarker> m);
  // nullptr if never recorded.
  std::shared_ptr<EventMarker> marker() const;

 private:
  const int device_;
  const unsigned flags_;
  mutable std::mutex mu_;
  std::shared_ptr<EventMarker> marker_;
};

}  // namespace simcuda
