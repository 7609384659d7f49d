// ncclGroupStart/End: calls made inside a group are held per thread and issued at the outermost End.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

#include "collective.h"
#include "communicator.h"

namespace simcuda::nccl {

struct PendingCall {
  std::shared_ptr<Communicator> comm;
  cudaStream_t stream;
  Collective call;
};

class GroupQueue {
 public:
  // The calling thread's queue.
  static GroupQueue& current();
  void start() { ++depth_; }
  // Returns the calls to issue when the outermost group ends (empty otherwise).
  std::vector<PendingCall> end();
  bool active() const { return depth_ > 0; }
  int depth() const { return depth_; }
  void add(PendingCall c) { calls_.push_back(std::move(c)); }

 private:
  int depth_ = 0;
  std::vector<PendingCall> calls_;
};

}  // namespace simcuda::nccl
