// Element-wise reductions over every ncclDataType_t for the built-in ncclRedOp_t values.
#pragma once

#include <nccl.h>

#include <cstddef>

namespace simcuda::nccl {

size_t type_size(ncclDataType_t type);  // 0 for an unknown type
bool valid_op(ncclRedOp_t op);

// acc[i] = op(acc[i], in[i]) for i < count. For ncclAvg this sums; call finish_average afterwards.
void reduce_into(void* acc, const void* in, size_t count, ncclDataType_t type, ncclRedOp_t op);
// For ncclAvg: divides by nranks (integer division for integer types, like NCCL).
void finish_average(void* acc, size_t count, ncclDataType_t type, int nranks);

}  // namespace simcuda::nccl
