// Sticky (process-wide, permanent) and per-thread "last error" state of the simulated runtime.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>

namespace simcuda {

class ErrorState {
 public:
  // The sticky error, or cudaSuccess. Once set, every runtime call returns it until process exit,
  // as after a device fault on a GPU.
  cudaError_t sticky() const { return static_cast<cudaError_t>(sticky_.load(std::memory_order_acquire)); }
  // First sticky error wins; later ones are ignored (a broken context stays broken the same way).
  void set_sticky(cudaError_t e);
  // Records `e` as this thread's last error (if it is an error) and returns it.
  cudaError_t record(cudaError_t e);
  // cudaGetLastError: returns and clears the thread's last error; a sticky error is never cleared.
  cudaError_t take_last();
  // cudaPeekAtLastError: returns without clearing.
  cudaError_t peek_last() const;

 private:
  std::atomic<int> sticky_{cudaSuccess};
};

}  // namespace simcuda
