// A training loop with a planted nondeterminism for proxy mode's replay validation (issue 16, JIT
// paper §4.1): the forward kernel reads a counter in mapped pinned memory directly, which the host
// bumps after the forward of each step without any CUDA call ("plant"). A replay of the step's calls
// then reads another value than the step did: the journal does not hold everything the device work
// depends on, and validation must find that. With "inplace" instead, the forward part updates a
// running statistic in place (as BatchNorm does): a replay from the buffers a failure before the
// optimizer step finds would update it twice, and validation must find that too.
// Usage: planted_nondeterminism <steps> [plant|inplace]
// Each step marks its minibatch and its optimizer step (jitckpt/marks.h). Prints the parameters'
// digest and ok=1; exits 2 on a failed call.
#include <cuda_runtime.h>

__global__ void forward(const float* param, float* out, const int* counter, int step, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 0.5f * param[i] + static_cast<float>(step % 7) + static_cast<float>(*counter);
}

// A running statistic (BatchNorm's kind): updated in place in the forward part of the step.
__global__ void running_stat(float* stat, const float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) stat[i] = 0.9f * stat[i] + 0.1f * out[i];
}

__global__ void update(float* param, const float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) param[i] = 0.9f * param[i] + 0.01f * out[i];
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(forward)
SIMCUDA_EXPORT_KERNEL(update)
SIMCUDA_EXPORT_KERNEL(running_stat)
#else
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "jitckpt/marks.h"

constexpr int N = 1000;

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("FAIL %s: %s\n", what, cudaGetErrorName(e));
    std::fflush(stdout);
    std::exit(2);
  }
}

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool plant = argc > 2 && std::strcmp(argv[2], "plant") == 0;
  const bool inplace = argc > 2 && std::strcmp(argv[2], "inplace") == 0;
  int* counter = nullptr;  // mapped pinned memory: the device reads it without a copy
  check(cudaHostAlloc(reinterpret_cast<void**>(&counter), sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
  *counter = 0;
  float *param = nullptr, *out = nullptr, *stat = nullptr;
  check(cudaMalloc(&param, N * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&out, N * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&stat, N * sizeof(float)), "cudaMalloc");
  check(cudaMemset(stat, 0, N * sizeof(float)), "cudaMemset");
  std::vector<float> host(N);
  for (int i = 0; i < N; ++i) host[i] = 0.001f * static_cast<float>(i);
  check(cudaMemcpy(param, host.data(), N * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  for (int s = 0; s < steps; ++s) {
    jitckpt_minibatch();
    forward<<<(N + 127) / 128, 128>>>(param, out, counter, s, N);
    check(cudaGetLastError(), "forward");
    if (inplace) {
      running_stat<<<(N + 127) / 128, 128>>>(stat, out, N);
      check(cudaGetLastError(), "running_stat");
    }
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    if (plant) ++*counter;  // device input that no CUDA call carries
    jitckpt_optimizer_step();
    update<<<(N + 127) / 128, 128>>>(param, out, N);
    check(cudaGetLastError(), "update");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  check(cudaMemcpy(host.data(), param, N * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  std::vector<float> stats(N);
  check(cudaMemcpy(stats.data(), stat, N * sizeof(float), cudaMemcpyDeviceToHost), "cudaMemcpy");
  host.insert(host.end(), stats.begin(), stats.end());
  uint64_t h = 0xcbf29ce484222325ULL;
  for (float v : host) {
    unsigned char b[sizeof v];
    std::memcpy(b, &v, sizeof v);
    for (unsigned char c : b) h = (h ^ c) * 0x100000001b3ULL;
  }
  std::printf("digest=%016llx\nok=1\n", static_cast<unsigned long long>(h));
  check(cudaFree(param), "cudaFree");
  check(cudaFree(out), "cudaFree");
  check(cudaFree(stat), "cudaFree");
  check(cudaFreeHost(counter), "cudaFreeHost");
  return 0;
}
#endif
