// Enqueues a registered kernel's host implementation on a stream, copying its arguments.
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_registry.h"

namespace simcuda {

cudaError_t launch_kernel(const KernelEntry* kernel, dim3 grid, dim3 block, void** args, size_t shared_mem,
                          cudaStream_t stream, bool per_thread_default);

}  // namespace simcuda
