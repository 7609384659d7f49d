#include "group_queue.h"

namespace simcuda::nccl {

GroupQueue& GroupQueue::current() {
  static thread_local GroupQueue q;
  return q;
}

std::vector<PendingCall> GroupQueue::end() {
  if (depth_ > 0) --depth_;
  if (depth_ > 0) return {};
  return std::move(calls_);
}

}  // namespace simcuda::nccl
