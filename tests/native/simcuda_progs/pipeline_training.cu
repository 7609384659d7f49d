// A native pipeline-parallel training program for SWIFT logging in the device proxy (issue 16,
// `jitckpt run --no-python --transparent --plugin logging`). Usage: pipeline_training <dir>
// <iterations> <checkpoint-every>; RANK and WORLD_SIZE from the launcher: stage RANK of WORLD_SIZE.
// Each stage has its own weights (no data parallelism). An iteration is a GPipe minibatch of MB
// micro-batches: the forward pass sends activations to the next stage, the backward pass sends
// gradients to the previous one (each over ncclSend/ncclRecv, with libjit.so's log context set),
// then SGD. Minibatch and optimizer-step marks (jitckpt/marks.h). Every <checkpoint-every>
// iterations each stage writes its weights to <dir>/stage<r>.ckpt (the global checkpoint; written
// to a temporary file, then renamed); a process that finds its stage's checkpoint starts after it.
// At the end: <dir>/final-rank<r>.bin, the weights' bytes. <dir>/progress-rank<r>: the last
// iteration done. Each iteration also waits ~PIPE_STEP_MS (default 20) on the host: its compute.
#include <cuda_runtime.h>

__global__ void make_input(float* x, int it, int mb, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = static_cast<float>((i * 7 + it * 13 + mb * 5) % 17) * 0.05f - 0.4f;
}

__global__ void forward(const float* w, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = w[i] * x[i] + 0.01f;
}

__global__ void loss_grad(const float* y, float* g, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) g[i] = y[i] - 0.25f;
}

__global__ void backward(const float* w, const float* x, const float* gy, float* gx, float* gw, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    gx[i] = gy[i] * w[i];
    gw[i] += gy[i] * x[i];
  }
}

__global__ void sgd(float* w, const float* gw, float lr, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) w[i] -= lr * gw[i];
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(make_input)
SIMCUDA_EXPORT_KERNEL(forward)
SIMCUDA_EXPORT_KERNEL(loss_grad)
SIMCUDA_EXPORT_KERNEL(backward)
SIMCUDA_EXPORT_KERNEL(sgd)
#else
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "jitckpt/jit_abi.h"
#include "jitckpt/marks.h"
#include "nccl_rank_setup.h"

constexpr int N = 2048, MB = 2, BLOCKS = (N + 255) / 256;

static void write_file(const std::string& path, const void* data, size_t size) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::perror(path.c_str());
    std::exit(4);
  }
}

int main(int argc, char** argv) {
  if (argc < 4 || std::getenv("RANK") == nullptr || std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "usage: RANK=r WORLD_SIZE=n %s <dir> <iterations> <checkpoint-every>\n", argv[0]);
    return 64;
  }
  const std::string dir = argv[1];
  const int iterations = std::atoi(argv[2]), every = std::atoi(argv[3]);
  const int rank = std::atoi(std::getenv("RANK")), world = std::atoi(std::getenv("WORLD_SIZE"));
  const int last = world - 1;
  const int step_ms = std::getenv("PIPE_STEP_MS") ? std::atoi(std::getenv("PIPE_STEP_MS")) : 20;
  auto get_api = reinterpret_cast<const jitckpt_api* (*)()>(dlsym(RTLD_DEFAULT, "jitckpt_api_v1"));
  const jitckpt_api* api = get_api != nullptr ? get_api() : nullptr;
  auto context = [api](int it, int mb, const char* payload) {
    if (api != nullptr) api->set_log_context(it, mb, payload);
  };

  // The weights: the global checkpoint's, or the initial ones.
  std::vector<float> w_host(N);
  int first = 1;
  const std::string ckpt = dir + "/stage" + std::to_string(rank) + ".ckpt";
  if (std::ifstream in{ckpt, std::ios::binary}) {
    int done = 0;
    in.read(reinterpret_cast<char*>(&done), sizeof done);
    in.read(reinterpret_cast<char*>(w_host.data()), N * sizeof(float));
    if (!in) {
      std::fprintf(stderr, "rank %d: %s is truncated\n", rank, ckpt.c_str());
      return 5;
    }
    first = done + 1;
    std::printf("resumed=%d\n", done);
  } else {
    for (int i = 0; i < N; ++i) w_host[i] = 0.5f + 0.001f * static_cast<float>((i + 31 * rank) % 97);
  }

  ncclUniqueId id;
  if (!exchange_unique_id_file(rank, dir + "/uid", &id)) return 64;
  cudaStream_t stream;
  ncclComm_t comm;
  CUDACHECK(cudaSetDevice(0));
  CUDACHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  NCCLCHECK(ncclCommInitRank(&comm, world, id, rank));
  float *w, *gw, *x[MB], *y[MB], *gy, *gx;
  CUDACHECK(cudaMalloc(&w, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&gw, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&gy, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&gx, N * sizeof(float)));
  for (int m = 0; m < MB; ++m) {
    CUDACHECK(cudaMalloc(&x[m], N * sizeof(float)));
    CUDACHECK(cudaMalloc(&y[m], N * sizeof(float)));
  }
  CUDACHECK(cudaMemcpy(w, w_host.data(), N * sizeof(float), cudaMemcpyHostToDevice));

  for (int it = first; it <= iterations; ++it) {
    jitckpt_minibatch();
    CUDACHECK(cudaMemsetAsync(gw, 0, N * sizeof(float), stream));  // zero_grad: the minibatch writes it first
    for (int m = 0; m < MB; ++m) {
      if (rank == 0) {
        make_input<<<BLOCKS, 256, 0, stream>>>(x[m], it, m, N);
      } else {
        context(it, m, "activation");
        NCCLCHECK(ncclRecv(x[m], N, ncclFloat32, rank - 1, comm, stream));
      }
      forward<<<BLOCKS, 256, 0, stream>>>(w, x[m], y[m], N);
      if (rank < last) {
        context(it, m, "activation");
        NCCLCHECK(ncclSend(y[m], N, ncclFloat32, rank + 1, comm, stream));
      }
    }
    for (int m = MB - 1; m >= 0; --m) {
      if (rank == last) {
        loss_grad<<<BLOCKS, 256, 0, stream>>>(y[m], gy, N);
      } else {
        context(it, m, "gradient");
        NCCLCHECK(ncclRecv(gy, N, ncclFloat32, rank + 1, comm, stream));
      }
      backward<<<BLOCKS, 256, 0, stream>>>(w, x[m], gy, gx, gw, N);
      if (rank > 0) {
        context(it, m, "gradient");
        NCCLCHECK(ncclSend(gx, N, ncclFloat32, rank - 1, comm, stream));
      }
    }
    jitckpt_optimizer_step();
    sgd<<<BLOCKS, 256, 0, stream>>>(w, gw, 0.01f, N);
    CUDACHECK(cudaStreamSynchronize(stream));
    if (every > 0 && it % every == 0) {
      std::vector<char> blob(sizeof(int) + N * sizeof(float));
      std::memcpy(blob.data(), &it, sizeof it);
      CUDACHECK(cudaMemcpy(blob.data() + sizeof it, w, N * sizeof(float), cudaMemcpyDeviceToHost));
      write_file(ckpt, blob.data(), blob.size());
    }
    write_file(dir + "/progress-rank" + std::to_string(rank), &it, sizeof it);
    if (step_ms > 0) usleep(static_cast<useconds_t>(step_ms) * 1000);
  }
  CUDACHECK(cudaMemcpy(w_host.data(), w, N * sizeof(float), cudaMemcpyDeviceToHost));
  write_file(dir + "/final-rank" + std::to_string(rank) + ".bin", w_host.data(), N * sizeof(float));
  if (api != nullptr) {
    char err[512] = {0};
    if (api->flush_send_log(30.0, err, sizeof err) != 0) std::printf("flush_error=%s\n", err);
  }
  std::printf("done=1\n");
  std::fflush(stdout);
  std::_Exit(0);  // no communicator teardown: a peer may already be gone
}
#endif
