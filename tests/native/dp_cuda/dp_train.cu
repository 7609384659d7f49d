// Data-parallel training step of a linear model y = X.w + b, as a real CUDA + NCCL program:
// forward/backward kernels on a compute stream, gradient all-reduce on a separate NCCL stream
// ordered with events (the ProcessGroupNCCL pattern), SGD with momentum on the device.
// Batches are generated on the device from (step, rank), so any run that reaches a step with the same
// parameters computes bitwise the same result. Driven from Python through ctypes (dp_train.py).
//
// Built twice (see interposer/CMakeLists.txt): with nvcc -cudart shared into libdp_train.so, and
// with -DSIMCUDA_HOST_KERNELS into libdp_train_kernels.so (host versions of the kernels for simcuda).
#include <cuda_runtime.h>

#ifndef SIMCUDA_HOST_KERNELS
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "jitckpt/marks.h"
#include "jitckpt/undo.h"
#endif

__global__ void generate_batch(float* x, float* y, long long step, int rank, int batch, int dim) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  // Deterministic pseudo-random features from (step, rank, i, j); target from a fixed linear map.
  float target = 0.5f;
  for (int j = 0; j < dim; ++j) {
    unsigned h = static_cast<unsigned>(step * 2654435761ull + rank * 40503u + i * 9176u + j * 131u);
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    float v = static_cast<float>(h & 0xffff) / 65536.0f - 0.5f;
    x[i * dim + j] = v;
    target += v * (0.1f * static_cast<float>((j % 7) - 3));
  }
  y[i] = target;
}

// residual[i] = x[i].w + b - y[i]
__global__ void forward(const float* x, const float* y, const float* params, float* residual, int batch,
                        int dim) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= batch) return;
  float pred = params[dim];
  for (int j = 0; j < dim; ++j) pred += x[i * dim + j] * params[j];
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

// Gradients were summed over ranks; average, then momentum SGD.
__global__ void sgd_momentum(float* params, float* velocity, const float* grad_sum, int n, int world, float lr,
                             float momentum) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float g = grad_sum[j] / static_cast<float>(world);
  velocity[j] = momentum * velocity[j] + g;
  params[j] -= lr * velocity[j];
}

// The inverse of sgd_momentum, for the undo plugin (jitckpt/undo.h): same parameters, run on the
// buffers sgd_momentum left. Exact as far as float arithmetic is (params: the same rounded product
// added back; velocity: a division).
__global__ void sgd_momentum_undo(float* params, float* velocity, const float* grad_sum, int n, int world, float lr,
                                  float momentum) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float g = grad_sum[j] / static_cast<float>(world);
  params[j] += lr * velocity[j];
  velocity[j] = momentum != 0.0f ? (velocity[j] - g) / momentum : 0.0f;
}

// checksum[0] = sum of the parameters, all-reduced inside the optimizer step (DP_TRAIN_CHECK_REPLICAS).
__global__ void param_checksum(const float* params, int n, float* checksum) {
  if (blockIdx.x * blockDim.x + threadIdx.x != 0) return;
  float s = 0.0f;
  for (int j = 0; j < n; ++j) s += params[j];
  checksum[0] = s;
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(generate_batch)
SIMCUDA_EXPORT_KERNEL(forward)
SIMCUDA_EXPORT_KERNEL(backward)
SIMCUDA_EXPORT_KERNEL(sgd_momentum)
SIMCUDA_EXPORT_KERNEL(sgd_momentum_undo)
SIMCUDA_EXPORT_KERNEL(param_checksum)
#else

namespace {

struct Trainer {
  int rank = 0, world = 1, dim = 0, batch = 0;
  // DP_TRAIN_OPTIMIZER_PAUSE=<step>:<ms>: at that step, once the all-reduce has completed and the
  // optimizer kernel is posted, dp_step says so on stdout and waits before it synchronizes, so a
  // test can fail this rank inside its optimizer step (issue 16 case 4).
  long long pause_step = -1;
  long pause_ms = 0;
  // DP_TRAIN_CHECK_REPLICAS=after: after the optimizer kernel, the ranks all-reduce a checksum of
  // their parameters: an NCCL call inside the optimizer step, as a ZeRO all-gather of updated
  // parameters or a replica consistency check would be (issue 16 case 4 with --plugin undo).
  // =before: the checksum of the parameters before the update is all-reduced first, and the
  // optimizer kernel waits for it (as gradient clipping's all-reduced norm does).
  bool check_replicas = false, check_first = false;
  float* checksum = nullptr;
  cudaEvent_t updated = nullptr, checked = nullptr;
  float lr = 0, momentum = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t compute = nullptr, comm_stream = nullptr;
  cudaEvent_t grad_ready = nullptr, reduced = nullptr;
  float *x = nullptr, *y = nullptr, *residual = nullptr, *grad = nullptr;
  float* state = nullptr;  // params (dim + 1) followed by velocity (dim + 1)
  int n() const { return dim + 1; }
};

Trainer* g_trainer = nullptr;  // one model per process (the library is a test program)

int fail(const char* what, int code) {
  std::fprintf(stderr, "dp_train: %s failed with %d\n", what, code);
  return code;
}

#define CUDA_OK(call)                                   \
  do {                                                  \
    cudaError_t e_ = (call);                            \
    if (e_ != cudaSuccess) return fail(#call, 1000 + e_); \
  } while (0)
#define NCCL_OK(call)                                  \
  do {                                                 \
    ncclResult_t r_ = (call);                          \
    if (r_ != ncclSuccess) return fail(#call, 2000 + r_); \
  } while (0)

unsigned blocks(int n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

// The optimizer step's all-reduce of a parameter checksum (see Trainer::check_replicas); the
// compute stream waits for it.
int check_replicas(Trainer* t) {
  param_checksum<<<1, 1, 0, t->compute>>>(t->state, t->n(), t->checksum);
  CUDA_OK(cudaEventRecord(t->updated, t->compute));
  CUDA_OK(cudaStreamWaitEvent(t->comm_stream, t->updated, 0));
  NCCL_OK(ncclAllReduce(t->checksum, t->checksum, 1, ncclFloat32, ncclSum, t->comm, t->comm_stream));
  CUDA_OK(cudaEventRecord(t->checked, t->comm_stream));
  CUDA_OK(cudaStreamWaitEvent(t->compute, t->checked, 0));
  return 0;
}

}  // namespace

extern "C" {

int dp_unique_id_size() { return static_cast<int>(sizeof(ncclUniqueId)); }

int dp_get_unique_id(char* out) {
  ncclUniqueId id;
  NCCL_OK(ncclGetUniqueId(&id));
  std::memcpy(out, &id, sizeof id);
  return 0;
}

int dp_init(int rank, int world, const char* unique_id, int device, int dim, int batch, float lr, float momentum) {
  auto* t = new Trainer();
  t->rank = rank;
  if (const char* pause = std::getenv("DP_TRAIN_OPTIMIZER_PAUSE")) std::sscanf(pause, "%lld:%ld", &t->pause_step, &t->pause_ms);
  if (const char* check = std::getenv("DP_TRAIN_CHECK_REPLICAS")) {
    t->check_first = std::strcmp(check, "before") == 0;
    t->check_replicas = t->check_first || std::strcmp(check, "after") == 0;
  }
  t->world = world;
  t->dim = dim;
  t->batch = batch;
  t->lr = lr;
  t->momentum = momentum;
  CUDA_OK(cudaSetDevice(device));
  ncclUniqueId id;
  std::memcpy(&id, unique_id, sizeof id);
  if (std::getenv("DP_TRAIN_COMM_CONFIG") != nullptr) {  // as ProcessGroupNCCL makes its communicators
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.commName = "dp_train";
    NCCL_OK(ncclCommInitRankConfig(&t->comm, world, id, rank, &config));
  } else {
    NCCL_OK(ncclCommInitRank(&t->comm, world, id, rank));
  }
  CUDA_OK(cudaStreamCreateWithFlags(&t->compute, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&t->comm_stream, cudaStreamNonBlocking));
  CUDA_OK(cudaEventCreateWithFlags(&t->grad_ready, cudaEventDisableTiming));
  CUDA_OK(cudaEventCreateWithFlags(&t->reduced, cudaEventDisableTiming));
  CUDA_OK(cudaMalloc(&t->x, sizeof(float) * batch * dim));
  CUDA_OK(cudaMalloc(&t->y, sizeof(float) * batch));
  CUDA_OK(cudaMalloc(&t->residual, sizeof(float) * batch));
  CUDA_OK(cudaMalloc(&t->grad, sizeof(float) * t->n()));
  CUDA_OK(cudaMalloc(&t->state, sizeof(float) * 2 * t->n()));
  CUDA_OK(cudaMemset(t->state, 0, sizeof(float) * 2 * t->n()));
  if (t->check_replicas) {
    CUDA_OK(cudaMalloc(&t->checksum, sizeof(float)));
    CUDA_OK(cudaEventCreateWithFlags(&t->updated, cudaEventDisableTiming));
    CUDA_OK(cudaEventCreateWithFlags(&t->checked, cudaEventDisableTiming));
  }
  // The optimizer step's kernels, for `jitckpt run --transparent --plugin undo`: sgd_momentum is
  // undone by its inverse, param_checksum writes nothing that outlives the minibatch.
  if (jitckpt_undo_with(reinterpret_cast<const void*>(sgd_momentum), reinterpret_cast<const void*>(sgd_momentum_undo)) ||
      jitckpt_undo_with(reinterpret_cast<const void*>(param_checksum), nullptr))
    return fail("jitckpt_register_inverse", 3);
  CUDA_OK(cudaDeviceSynchronize());
  g_trainer = t;
  return 0;
}

int dp_state_size() { return g_trainer ? 2 * g_trainer->n() : 0; }

// One training step; blocks in cudaStreamSynchronize until the step is done on the device.
int dp_step(long long step) {
  Trainer* t = g_trainer;
  if (t == nullptr) return fail("dp_step before dp_init", 1);
  float* params = t->state;
  float* velocity = t->state + t->n();
  jitckpt_minibatch();  // proxy mode's replay journal keeps this minibatch's calls only
  generate_batch<<<blocks(t->batch, 64), 64, 0, t->compute>>>(t->x, t->y, step, t->rank, t->batch, t->dim);
  forward<<<blocks(t->batch, 64), 64, 0, t->compute>>>(t->x, t->y, params, t->residual, t->batch, t->dim);
  backward<<<blocks(t->n(), 64), 64, 0, t->compute>>>(t->x, t->residual, t->grad, t->batch, t->dim);
  CUDA_OK(cudaGetLastError());
  // NCCL stream waits for the gradients; compute stream waits for the all-reduce.
  CUDA_OK(cudaEventRecord(t->grad_ready, t->compute));
  CUDA_OK(cudaStreamWaitEvent(t->comm_stream, t->grad_ready, 0));
  NCCL_OK(ncclAllReduce(t->grad, t->grad, t->n(), ncclFloat32, ncclSum, t->comm, t->comm_stream));
  CUDA_OK(cudaEventRecord(t->reduced, t->comm_stream));
  CUDA_OK(cudaStreamWaitEvent(t->compute, t->reduced, 0));
  jitckpt_optimizer_step();
  if (t->check_first && check_replicas(t) != 0) return 1;
  sgd_momentum<<<blocks(t->n(), 64), 64, 0, t->compute>>>(params, velocity, t->grad, t->n(), t->world, t->lr,
                                                          t->momentum);
  CUDA_OK(cudaGetLastError());
  if (t->check_replicas && !t->check_first && check_replicas(t) != 0) return 1;
  if (step == t->pause_step) {  // see Trainer::pause_step
    // The test kills this rank once every rank has printed: the all-reduce must be done by then,
    // however slowly the proxies run.
    CUDA_OK(cudaEventSynchronize(t->reduced));
    std::printf("rank %d: in the optimizer step of step %lld\n", t->rank, step);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(t->pause_ms));
  }
  CUDA_OK(cudaStreamSynchronize(t->compute));
  return 0;
}

// Device -> host copy of params and velocity with plain cudaMemcpy (legacy default stream): the
// save path. During a JIT save libjit.so moves it to a fresh stream.
int dp_get_state(float* host) {
  Trainer* t = g_trainer;
  if (t == nullptr) return fail("dp_get_state before dp_init", 1);
  CUDA_OK(cudaMemcpy(host, t->state, sizeof(float) * 2 * t->n(), cudaMemcpyDeviceToHost));
  return 0;
}

int dp_set_state(const float* host) {
  Trainer* t = g_trainer;
  if (t == nullptr) return fail("dp_set_state before dp_init", 1);
  CUDA_OK(cudaMemcpy(t->state, host, sizeof(float) * 2 * t->n(), cudaMemcpyHostToDevice));
  return 0;
}

// Blocks the calling thread until the NCCL stream is idle (used by tests to hold the GIL while hung).
int dp_wait_comm() {
  CUDA_OK(cudaStreamSynchronize(g_trainer->comm_stream));
  return 0;
}

}  // extern "C"
#endif
