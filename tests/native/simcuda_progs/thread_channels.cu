// Threads that come and go, each making CUDA calls (issue 15: a channel per thread in proxy mode).
// Between phases the program prints a line and waits for one on stdin, so a test can count the
// proxy's threads: with N threads alive and making calls, and after they exited.
//   phase "alive": N threads have made their calls and wait; "gone": they exited;
//   "churn": 3 N more threads ran one after another and exited.
// Each thread checks it starts on device 0 (per-thread state is not inherited from an earlier
// thread) and then works on device 1.
#include <cuda_runtime.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

static std::mutex mu;
static std::condition_variable cv;
static int done = 0;
static bool release = false;
static int bad = 0;

static void work(bool wait) {
  int dev = -1;
  bool ok = cudaGetDevice(&dev) == cudaSuccess && dev == 0 && cudaSetDevice(1) == cudaSuccess;
  void* p = nullptr;
  ok = ok && cudaMalloc(&p, 4096) == cudaSuccess && cudaMemset(p, 7, 4096) == cudaSuccess;
  ok = ok && cudaDeviceSynchronize() == cudaSuccess && cudaFree(p) == cudaSuccess;
  std::unique_lock<std::mutex> lock(mu);
  if (!ok) ++bad;
  ++done;
  cv.notify_all();
  if (wait) cv.wait(lock, [] { return release; });
}

static void phase(const char* name) {
  std::printf("phase=%s\n", name);
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);
}

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 4;
  if (cudaSetDevice(0) != cudaSuccess) return 1;  // the main thread's channel, opened first
  phase("start");
  std::vector<std::thread> alive;
  for (int i = 0; i < n; ++i) alive.emplace_back(work, true);
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == n; });
  }
  phase("alive");
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  for (auto& t : alive) t.join();
  phase("gone");
  for (int i = 0; i < 3 * n; ++i) std::thread(work, false).join();
  phase("churn");
  int dev = -1;
  cudaGetDevice(&dev);
  std::printf("bad=%d main_device=%d\nok=%d\n", bad, dev, bad == 0 && dev == 0);
  return bad == 0 && dev == 0 ? 0 : 1;
}
