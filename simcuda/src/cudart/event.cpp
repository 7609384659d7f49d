#include "event.h"

#include <cuda_runtime_api.h>

namespace simcuda {

bool Event::timing_disabled() const { return (flags_ & cudaEventDisableTiming) != 0; }

void Event::set_marker(std::shared_ptr<EventMarker> m) {
  std::lock_guard<std::mutex> lock(mu_);
  marker_ = std::move(m);
}

std::shared_ptr<EventMarker> Event::marker() const {
  std::lock_guard<std::mutex> lock(mu_);
  return marker_;
}

}  // namespace simcuda
