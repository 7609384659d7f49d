// The device side of a jitckpt.protect() training script (tests/native/protect_train.py, run by
// tests/native/test_protect_marks.py): a linear model whose input batch is copied from host memory
// into one device buffer reused every step, as `x = batch.to(device)` is before `model(x)`, and whose
// forward scales that buffer in place before it reads it (an in-place first op on the input). So the
// input buffer no longer holds the batch once the forward ran: a replay of the minibatch is right only
// if its journal holds the batch's host-to-device copy (the minibatch mark came before the copy).
//
// Built with nvcc -shared into a library Python loads through ctypes, and with -DSIMCUDA_HOST_KERNELS
// into its host kernel library (simcuda_harness.build_program).
#include <cuda_runtime.h>

#ifndef SIMCUDA_HOST_KERNELS
#include <nccl.h>

#include <cstdio>
#endif

// x = 0.5 x - 0.25: not idempotent, so applying it twice to one batch changes the gradients.
__global__ void scale_input(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = 0.5f * x[i] - 0.25f;
}

// residual[i] = x[i].w + b - y[i]
__global__ void forward(const float* x, const float* y, const float* w, float* residual, int batch, int dim) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  float pred = w[dim];
  for (int j = 0; j < dim; ++j) pred += x[i * dim + j] * w[j];
  residual[i] = pred - y[i];
}

// grad[j] = 2/B sum_i residual[i] x[i][j]; grad[dim] (bias) = 2/B sum_i residual[i]
__global__ void backward(const float* x, const float* residual, float* grad, int batch, int dim) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j > dim) return;
  float g = 0.0f;
  for (int i = 0; i < batch; ++i) g += residual[i] * (j == dim ? 1.0f : x[i * dim + j]);
  grad[j] = 2.0f * g / static_cast<float>(batch);
}

__global__ void sgd(float* w, const float* grad, int n, float lr) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < n) w[j] -= lr * grad[j];
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(scale_input)
SIMCUDA_EXPORT_KERNEL(forward)
SIMCUDA_EXPORT_KERNEL(backward)
SIMCUDA_EXPORT_KERNEL(sgd)
#else

namespace {

struct Model {
  int dim = 0, batch = 0;
  ncclComm_t comm = nullptr;  // one rank: the gradients' all-reduce is the collective a failure hits
  cudaStream_t stream = nullptr;
  float *x = nullptr, *y = nullptr, *w = nullptr, *residual = nullptr, *grad = nullptr;
  int n() const { return dim + 1; }
};

Model g_model;  // one model per process (the library is a test program)

int fail(const char* what, int code) {
  std::fprintf(stderr, "protect_input: %s failed with %d\n", what, code);
  return code;
}

#define CUDA_OK(call)                                     \
  do {                                                    \
    cudaError_t e_ = (call);                              \
    if (e_ != cudaSuccess) return fail(#call, 1000 + e_); \
  } while (0)
#define NCCL_OK(call)                                     \
  do {                                                    \
    ncclResult_t r_ = (call);                             \
    if (r_ != ncclSuccess) return fail(#call, 2000 + r_); \
  } while (0)

unsigned blocks(int n) { return static_cast<unsigned>((n + 63) / 64); }

}  // namespace

extern "C" {

int pi_init(int dim, int batch) {
  Model& m = g_model;
  m.dim = dim;
  m.batch = batch;
  ncclUniqueId id;
  NCCL_OK(ncclGetUniqueId(&id));
  NCCL_OK(ncclCommInitRank(&m.comm, 1, id, 0));
  CUDA_OK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  CUDA_OK(cudaMalloc(&m.x, sizeof(float) * batch * dim));
  CUDA_OK(cudaMalloc(&m.y, sizeof(float) * batch));
  CUDA_OK(cudaMalloc(&m.w, sizeof(float) * m.n()));
  CUDA_OK(cudaMalloc(&m.residual, sizeof(float) * batch));
  CUDA_OK(cudaMalloc(&m.grad, sizeof(float) * m.n()));
  CUDA_OK(cudaMemset(m.w, 0, sizeof(float) * m.n()));
  CUDA_OK(cudaDeviceSynchronize());
  return 0;
}

// The batch (x: batch * dim floats, then y: batch floats) from pageable host memory into the
// device buffers every step reuses, stream-ordered before the forward (the copy is staged at the call).
int pi_load_batch(const float* host) {
  Model& m = g_model;
  CUDA_OK(cudaMemcpyAsync(m.x, host, sizeof(float) * m.batch * m.dim, cudaMemcpyHostToDevice, m.stream));
  CUDA_OK(cudaMemcpyAsync(m.y, host + m.batch * m.dim, sizeof(float) * m.batch, cudaMemcpyHostToDevice, m.stream));
  return 0;
}

// Forward (scaling the input in place first) and backward, then the gradients' all-reduce; waits
// for them as `loss.item()` would.
int pi_forward_backward() {
  Model& m = g_model;
  scale_input<<<blocks(m.batch * m.dim), 64, 0, m.stream>>>(m.x, m.batch * m.dim);
  forward<<<blocks(m.batch), 64, 0, m.stream>>>(m.x, m.y, m.w, m.residual, m.batch, m.dim);
  backward<<<blocks(m.n()), 64, 0, m.stream>>>(m.x, m.residual, m.grad, m.batch, m.dim);
  CUDA_OK(cudaGetLastError());
  NCCL_OK(ncclAllReduce(m.grad, m.grad, m.n(), ncclFloat32, ncclSum, m.comm, m.stream));
  CUDA_OK(cudaStreamSynchronize(m.stream));
  return 0;
}

int pi_optimizer_step(float lr) {
  Model& m = g_model;
  sgd<<<blocks(m.n()), 64, 0, m.stream>>>(m.w, m.grad, m.n(), lr);
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaStreamSynchronize(m.stream));
  return 0;
}

int pi_param_count() { return g_model.n(); }

int pi_get_params(float* host) {
  CUDA_OK(cudaMemcpy(host, g_model.w, sizeof(float) * g_model.n(), cudaMemcpyDeviceToHost));
  return 0;
}

}  // extern "C"
#endif
