// One NCCL operation (collective or point-to-point) as recorded at call time.
#pragma once

#include <nccl.h>

#include <cstddef>

namespace simcuda::nccl {

struct Collective {
  enum class Kind { AllReduce, Broadcast, Reduce, AllGather, ReduceScatter, AllToAll, Gather, Send, Recv };
  Kind kind;
  const void* send;
  void* recv;
  size_t count;  // elements per rank, as in the NCCL API of each call
  ncclDataType_t type;
  ncclRedOp_t op;
  int peer;  // root for rooted collectives, peer for send/recv

  bool is_p2p() const { return kind == Kind::Send || kind == Kind::Recv; }
};

}  // namespace simcuda::nccl
