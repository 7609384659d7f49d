// Stream/event semantics. Usage: streams_events async|sticky
// Host-function "gates" hold a stream at a known point without sleeping: the stream worker blocks
// in the gate until main() opens it, which proves the enqueueing call returned to the host first.
// Prints "key=value" lines checked by tests/native/test_simcuda_runtime.py.
#include <cuda_runtime.h>

__global__ void add_one(int* p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) p[i] += 1;
}

__global__ void faulting(int* p, int code) {
#ifdef SIMCUDA_HOST_KERNELS
  simcuda_fault(code);  // on simcuda: the launch fails asynchronously with `code`
#else
  if (p[code] == 0x7fffffff) __trap();  // never true on a GPU; keeps the kernel well-formed
#endif
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(add_one)
SIMCUDA_EXPORT_KERNEL(faulting)
#else
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define CHECK(call)                                                              \
  do {                                                                           \
    cudaError_t e_ = (call);                                                     \
    if (e_ != cudaSuccess) {                                                     \
      std::printf("FAIL line %d %s: %s\n", __LINE__, #call, cudaGetErrorName(e_)); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

// A host function that blocks its stream until open() is called.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool is_open = false;
  static void CUDART_CB wait(void* self) {
    auto* g = static_cast<Gate*>(self);
    std::unique_lock<std::mutex> lock(g->mu);
    g->cv.wait(lock, [g] { return g->is_open; });
  }
  void open() {
    std::lock_guard<std::mutex> lock(mu);
    is_open = true;
    cv.notify_all();
  }
};

static void CUDART_CB busy_20ms(void*) {  // runs on the stream: simulated device work with a duration
  auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
  while (std::chrono::steady_clock::now() < end) {
  }
}

static const char* name(cudaError_t e) { return cudaGetErrorName(e); }

static int run_async() {
  const int n = 256;
  int *d = nullptr, *d2 = nullptr;
  CHECK(cudaMalloc(&d, n * sizeof(int)));
  CHECK(cudaMalloc(&d2, n * sizeof(int)));
  CHECK(cudaMemset(d, 0, n * sizeof(int)));
  cudaStream_t a, b, c;
  CHECK(cudaStreamCreate(&a));                                 // blocking w.r.t. the legacy stream
  CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  cudaEvent_t ev_a, t0, t1, untimed;
  CHECK(cudaEventCreate(&ev_a));
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming));

  // 1. Work queued behind a closed gate: the host gets control back immediately.
  Gate gate;
  CHECK(cudaLaunchHostFunc(a, Gate::wait, &gate));
  CHECK(cudaMemsetAsync(d, 2, n * sizeof(int), a));
  add_one<<<1, n, 0, a>>>(d, n);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(ev_a, a));
  std::printf("host_returned_while_stream_blocked=1\n");
  std::printf("stream_a_query=%s\n", name(cudaStreamQuery(a)));
  std::printf("event_a_query=%s\n", name(cudaEventQuery(ev_a)));

  // 2. Stream b waits for ev_a; its copy must see a's memset + kernel.
  CHECK(cudaStreamWaitEvent(b, ev_a, 0));
  CHECK(cudaMemcpyAsync(d2, d, n * sizeof(int), cudaMemcpyDeviceToDevice, b));
  std::printf("stream_b_query_before=%s\n", name(cudaStreamQuery(b)));

  // 3. The legacy default stream waits for blocking stream a; non-blocking stream c does not.
  int* d3 = nullptr;  // the legacy and non-blocking streams are unordered: give them their own buffer
  CHECK(cudaMalloc(&d3, 16 * sizeof(int)));
  CHECK(cudaMemsetAsync(d3, 0, 4, 0));  // queued behind a (and behind nothing else)
  std::printf("legacy_query_before=%s\n", name(cudaStreamQuery(0)));
  CHECK(cudaMemsetAsync(d3 + 8, 0, 4, c));
  CHECK(cudaStreamSynchronize(c));
  std::printf("nonblocking_c_done_while_a_blocked=%s\n", name(cudaStreamQuery(c)));

  gate.open();
  CHECK(cudaStreamSynchronize(b));
  std::vector<int> h(n);
  CHECK(cudaMemcpy(h.data(), d2, n * sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("cross_stream_value=%d\n", h[100]);
  std::printf("event_a_after=%s\n", name(cudaEventQuery(ev_a)));
  CHECK(cudaDeviceSynchronize());
  std::printf("legacy_query_after=%s\n", name(cudaStreamQuery(0)));

  // 4. Elapsed time around 20 ms of stream work; timing-disabled and unfinished events fail.
  Gate gate2;
  CHECK(cudaEventRecord(t0, b));
  CHECK(cudaLaunchHostFunc(b, busy_20ms, nullptr));
  CHECK(cudaLaunchHostFunc(b, Gate::wait, &gate2));
  CHECK(cudaEventRecord(t1, b));
  CHECK(cudaEventRecord(untimed, b));
  float ms = -1;
  std::printf("elapsed_not_ready=%s\n", name(cudaEventElapsedTime(&ms, t0, t1)));
  cudaGetLastError();
  gate2.open();
  CHECK(cudaEventSynchronize(t1));
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  std::printf("elapsed_ms_ge_19=%d\n", ms >= 19.0f ? 1 : 0);
  std::printf("elapsed_untimed=%s\n", name(cudaEventElapsedTime(&ms, t0, untimed)));
  cudaGetLastError();

  // 5. An async copy from pageable memory is staged: overwriting the source right after the call
  //    (while the stream is still held by a gate) does not change what lands on the device.
  Gate gate3;
  std::vector<int> src(n, 11);
  CHECK(cudaLaunchHostFunc(c, Gate::wait, &gate3));
  CHECK(cudaMemcpyAsync(d, src.data(), n * sizeof(int), cudaMemcpyHostToDevice, c));
  std::fill(src.begin(), src.end(), -1);
  gate3.open();
  CHECK(cudaStreamSynchronize(c));
  std::vector<int> staged(n);
  CHECK(cudaMemcpy(staged.data(), d, n * sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("h2d_pageable_staged=%d\n", staged[0] == 11 && staged[n - 1] == 11 ? 1 : 0);

  // 6. Per-thread default stream and stream priorities.
  int v = 0;
  CHECK(cudaMemcpyAsync(&v, d2 + 100, sizeof(int), cudaMemcpyDeviceToHost, cudaStreamPerThread));
  CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  std::printf("per_thread_value=%d\n", v);
  int least = 1, greatest = 1, prio = 1;
  CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t hi;
  CHECK(cudaStreamCreateWithPriority(&hi, cudaStreamNonBlocking, greatest));
  CHECK(cudaStreamGetPriority(hi, &prio));
  std::printf("priority_range=%d..%d\n", least, greatest);
  std::printf("priority_kept=%d\n", prio == greatest ? 1 : 0);
  unsigned flags = 0;
  CHECK(cudaStreamGetFlags(hi, &flags));
  std::printf("flags_nonblocking=%d\n", flags == cudaStreamNonBlocking ? 1 : 0);

  // 7. Invalid handles are non-sticky errors.
  CHECK(cudaStreamDestroy(hi));
  std::printf("destroyed_stream_query=%s\n", name(cudaStreamQuery(hi)));
  std::printf("after_invalid=%s\n", name(cudaGetLastError()));
  std::printf("still_works=%s\n", name(cudaMemset(d, 0, 4)));
  std::printf("done=1\n");
  return 0;
}

static int run_sticky() {
  int* d = nullptr;
  CHECK(cudaMalloc(&d, 64));
  faulting<<<1, 1>>>(d, 700);  // 700 = cudaErrorIllegalAddress
  std::printf("launch=%s\n", name(cudaGetLastError()));  // the launch itself is accepted
  std::printf("sync=%s\n", name(cudaDeviceSynchronize()));
  std::printf("get_last_1=%s\n", name(cudaGetLastError()));
  std::printf("get_last_2=%s\n", name(cudaGetLastError()));  // sticky: not cleared
  void* p = nullptr;
  std::printf("malloc_after=%s\n", name(cudaMalloc(&p, 16)));
  int h = 0;
  std::printf("memcpy_after=%s\n", name(cudaMemcpy(&h, d, 4, cudaMemcpyDeviceToHost)));
  cudaStream_t s;
  std::printf("stream_create_after=%s\n", name(cudaStreamCreate(&s)));
  std::printf("error_string=%s\n", cudaGetErrorString(cudaErrorIllegalAddress));
  std::printf("done=1\n");
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "async") return run_async();
  if (mode == "sticky") return run_sticky();
  std::fprintf(stderr, "usage: %s async|sticky\n", argv[0]);
  return 64;
}
#endif
