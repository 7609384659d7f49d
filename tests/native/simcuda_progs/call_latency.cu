// Per-call latency of the CUDA runtime as the application sees it (bench/bench_proxy.py runs it
// directly, under observe mode and under proxy mode): a synchronous call that returns a value
// (cudaGetDevice), and two stream-ordered calls whose result is not waited for (cudaEventRecord
// and a kernel launch). Each call is timed on its own; the medians are printed as key=value.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

__global__ void bump(int* counter, int by) {
  if (blockIdx.x == 0 && threadIdx.x == 0) *counter += by;
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(bump)
#else

#define CHECK(call)                                                       \
  do {                                                                    \
    cudaError_t e_ = (call);                                              \
    if (e_ != cudaSuccess) {                                              \
      std::printf("FAIL %s: %s\n", #call, cudaGetErrorName(e_));          \
      return 2;                                                           \
    }                                                                     \
  } while (0)

using Clock = std::chrono::steady_clock;

double median_ns(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 20000;
  const int batch = 256;  // stream-ordered calls between two synchronizations (not timed)
  CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t event;
  CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  int* counter = nullptr;
  CHECK(cudaMalloc(&counter, sizeof(int)));
  CHECK(cudaMemset(counter, 0, sizeof(int)));
  bump<<<1, 1, 0, stream>>>(counter, 0);  // first launch registers the kernel
  CHECK(cudaStreamSynchronize(stream));

  std::vector<double> clock_ns, sync_ns, cold_sync_ns, cold_step_ns, record_ns, launch_ns;
  for (int i = 0; i < iters; ++i) {
    auto a = Clock::now();
    auto b = Clock::now();
    clock_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  int device = -1;
  for (int i = 0; i < iters; ++i) {
    auto a = Clock::now();
    cudaError_t e = cudaGetDevice(&device);
    auto b = Clock::now();
    if (e != cudaSuccess) return 3;
    sync_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  for (int i = 0; i < iters; ++i) {
    auto a = Clock::now();
    cudaError_t e = cudaEventRecord(event, stream);
    auto b = Clock::now();
    if (e != cudaSuccess) return 4;
    record_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
    if (i % batch == batch - 1) CHECK(cudaStreamSynchronize(stream));
  }
  for (int i = 0; i < iters; ++i) {
    auto a = Clock::now();
    bump<<<1, 1, 0, stream>>>(counter, 1);
    auto b = Clock::now();
    launch_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
    if (i % batch == batch - 1) CHECK(cudaStreamSynchronize(stream));
  }
  CHECK(cudaStreamSynchronize(stream));
  // The same call after 1 ms of quiet: through a proxy, the proxy has gone to sleep and must be
  // woken (what a call costs at the start of a step); directly, nothing changes.
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto a = Clock::now();
    cudaError_t e = cudaGetDevice(&device);
    auto b = Clock::now();
    if (e != cudaSuccess) return 3;
    cold_sync_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  // A kernel and a synchronize after 1 ms of quiet: the device's stream thread (and, through a
  // proxy, the proxy) must be woken, and then the caller: the floor of a step that starts cold.
  for (int i = 0; i < 200; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto a = Clock::now();
    bump<<<1, 1, 0, stream>>>(counter, 0);
    cudaError_t e = cudaStreamSynchronize(stream);
    auto b = Clock::now();
    if (e != cudaSuccess) return 3;
    cold_step_ns.push_back(std::chrono::duration<double, std::nano>(b - a).count());
  }
  CHECK(cudaGetLastError());
  int total = 0;
  CHECK(cudaMemcpy(&total, counter, sizeof total, cudaMemcpyDeviceToHost));
  std::printf("iters=%d\nclock_ns=%.0f\nsync_ns=%.0f\ncold_sync_ns=%.0f\ncold_step_ns=%.0f\nevent_record_ns=%.0f\n"
              "launch_ns=%.0f\ncounter=%d\nok=%d\n", iters, median_ns(clock_ns), median_ns(sync_ns),
              median_ns(cold_sync_ns), median_ns(cold_step_ns), median_ns(record_ns), median_ns(launch_ns), total,
              total == iters ? 1 : 0);
  CHECK(cudaFree(counter));
  return total == iters ? 0 : 1;
}
#endif
