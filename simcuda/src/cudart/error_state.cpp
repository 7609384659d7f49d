#include "error_state.h"

namespace simcuda {
namespace {
thread_local cudaError_t t_last_error = cudaSuccess;
}

void ErrorState::set_sticky(cudaError_t e) {
  int expected = cudaSuccess;
  sticky_.compare_exchange_strong(expected, e, std::memory_order_acq_rel);
}

cudaError_t ErrorState::record(cudaError_t e) {
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_error = e;  // NotReady is not an error
  return e;
}

cudaError_t ErrorState::take_last() {
  if (cudaError_t s = sticky(); s != cudaSuccess) return s;
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t ErrorState::peek_last() const {
  if (cudaError_t s = sticky(); s != cudaSuccess) return s;
  return t_last_error;
}

}  // namespace simcuda
