// Threads that each keep their own device state and check it every iteration (issue 16): a device
// proxy replaced under them must give every thread its channel back with its current device, its
// stream and its buffer's contents. Usage: threads_recovery <threads> <iterations>
// Thread t works on device t % 2 (run with SIMCUDA_DEVICES=2): a stream, a buffer it adds t + 1 to
// per iteration, read back and checked. Prints "bad=<mismatches>" and "ok=1" if there were none;
// exits 2 on a failed call.
#include <cuda_runtime.h>

__global__ void bump(int* p, int n, int v) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += v;
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(bump)
#else
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

static std::atomic<long> bad{0};
constexpr int N = 4096;

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::printf("FAIL %s: %s\n", what, cudaGetErrorName(e));
    std::fflush(stdout);
    std::exit(2);
  }
}

static void work(int t, int iterations) {
  check(cudaSetDevice(t % 2), "cudaSetDevice");
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  int* d = nullptr;
  check(cudaMalloc(&d, N * sizeof(int)), "cudaMalloc");
  check(cudaMemsetAsync(d, 0, N * sizeof(int), s), "cudaMemsetAsync");
  std::vector<int> h(N);
  for (int it = 1; it <= iterations; ++it) {
    bump<<<(N + 255) / 256, 256, 0, s>>>(d, N, t + 1);
    check(cudaGetLastError(), "bump");
    check(cudaMemcpyAsync(h.data(), d, N * sizeof(int), cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    int dev = -1;
    check(cudaGetDevice(&dev), "cudaGetDevice");
    if (dev != t % 2) ++bad;
    for (int i = 0; i < N; ++i)
      if (h[i] != it * (t + 1)) {
        ++bad;
        break;
      }
  }
  check(cudaFree(d), "cudaFree");
  check(cudaStreamDestroy(s), "cudaStreamDestroy");
}

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <threads> <iterations>\n", argv[0]);
    return 64;
  }
  const int threads = std::atoi(argv[1]), iterations = std::atoi(argv[2]);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t, iterations);
  for (auto& th : pool) th.join();
  std::printf("bad=%ld\n", bad.load());
  if (bad.load() == 0) std::printf("ok=1\n");
  return bad.load() == 0 ? 0 : 1;
}
#endif
