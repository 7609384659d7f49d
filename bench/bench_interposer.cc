// Cost of CUDA runtime calls, direct or through LD_PRELOAD=libjit.so. Prints one line per call:
//   <name> <ns per call, best of R repetitions>
// bench/bench_interposer.py runs it with and without the preload and prints the difference.
// Calls use null/invalid handles so they return at once on any backend (real libcudart without a
// GPU returns an error code, simcuda validates handles): we measure call overhead, not device work.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>

namespace {

double best_ns_per_call(const std::function<void()>& body, long iters, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < iters; ++i) body();
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(iters);
    if (ns < best) best = ns;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  long iters = argc > 1 ? std::atol(argv[1]) : 200000;
  int reps = argc > 2 ? std::atoi(argv[2]) : 7;
  volatile int sink = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t event = nullptr;
  // Interposed (pass-through path) and, as a control, not interposed.
  struct Case {
    const char* name;
    std::function<void()> body;
  } cases[] = {
      {"cudaGetLastError(not-interposed)", [&] { sink += cudaGetLastError(); }},
      {"cudaEventQuery(not-interposed)", [&] { sink += cudaEventQuery(event); }},
      {"cudaStreamQuery(not-interposed)", [&] { sink += cudaStreamQuery(stream); }},
      {"cudaEventRecord", [&] { sink += cudaEventRecord(event, stream); }},
      {"cudaStreamWaitEvent", [&] { sink += cudaStreamWaitEvent(stream, event, 0); }},
      {"cudaMemcpyAsync", [&] { sink += cudaMemcpyAsync(nullptr, nullptr, 0, cudaMemcpyDeviceToHost, stream); }},
      {"cudaStreamSynchronize", [&] { sink += cudaStreamSynchronize(stream); }},
  };
  for (auto& c : cases) {
    c.body();  // resolve lazily bound symbols outside the timed loop
    std::printf("%s %.2f\n", c.name, best_ns_per_call(c.body, iters, reps));
  }
  cudaGetLastError();
  return sink == 0x7fffffff;  // keep sink alive
}
