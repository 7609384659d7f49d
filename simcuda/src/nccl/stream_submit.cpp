#include "stream_submit.h"

extern "C" cudaError_t simcudaStreamEnqueue(cudaStream_t stream, void (*fn)(void*), void* data);
extern "C" cudaError_t simcudaGetStickyError(void);

namespace simcuda::nccl {
namespace {
struct StreamWork {
  std::shared_ptr<Communicator> comm;
  std::function<void()> work;
};

void run_work(void* data) {
  std::unique_ptr<StreamWork> w(static_cast<StreamWork*>(data));
  if (simcudaGetStickyError() == cudaSuccess) w->work();  // a faulted GPU runs no more kernels
  w->comm->op_finished();
}
}  // namespace

ncclResult_t submit_to_stream(const std::shared_ptr<Communicator>& comm, cudaStream_t stream,
                              std::function<void()> work) {
  auto w = std::make_unique<StreamWork>(StreamWork{comm, std::move(work)});
  comm->op_enqueued();
  if (simcudaStreamEnqueue(stream, &run_work, w.get()) != cudaSuccess) {
    comm->op_finished();
    return ncclUnhandledCudaError;
  }
  w.release();  // owned by the stream op now
  return ncclSuccess;
}

}  // namespace simcuda::nccl
