// The per-thread stack behind <<<...>>>: __cudaPushCallConfiguration / __cudaPopCallConfiguration.
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

namespace simcuda {

struct LaunchConfig {
  dim3 grid;
  dim3 block;
  size_t shared_mem;
  cudaStream_t stream;
};

// Thread-local: nvcc pushes in the caller and pops in the host stub on the same thread.
std::vector<LaunchConfig>& launch_config_stack();

}  // namespace simcuda
