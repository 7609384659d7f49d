// Puts communicator work on a CUDA stream of simcuda's libcudart (SIMCUDA_PRIVATE entry point).
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <functional>
#include <memory>

#include "communicator.h"

namespace simcuda::nccl {

// Enqueues `work` on `stream`, tracked as an outstanding op of `comm`. ncclUnhandledCudaError if the
// runtime refuses (invalid stream, or a sticky CUDA error).
ncclResult_t submit_to_stream(const std::shared_ptr<Communicator>& comm, cudaStream_t stream,
                              std::function<void()> work);

}  // namespace simcuda::nccl
