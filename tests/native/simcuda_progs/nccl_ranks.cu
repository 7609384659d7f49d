// One NCCL rank per process. Usage: nccl_ranks <mode> <rank> <nranks> [unique-id-hex] [window-ms]
// Rank 0 creates the unique id and prints "uid=<hex>" before joining; the test passes that hex to the
// other ranks. Modes:
//   collectives  every collective/dtype/op, results checked locally; prints ok_<name>=0|1
//   stop         allreduce, print phase1_done, wait for "go" on stdin, allreduce again and report
//                whether its event stays cudaErrorNotReady for the window, then ncclCommAbort
//   split        ncclCommSplit by color rank % 2 (key -rank), then an allreduce in each part
//   bench        float32 allreduce of <window-ms> MiB: one warm-up, then 5 timed; prints ms_per_iter
//   inject       three allreduces with an event after each; reports call results, event states
//                after the window, the async error and a cudaMalloc probe (failure injection tests)
// No kernels: host code only, built with nvcc -cudart shared.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "nccl_rank_setup.h"

static int g_rank, g_nranks;
static cudaStream_t g_stream;
static ncclComm_t g_comm;

template <typename T>
static T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  CUDACHECK(cudaMalloc(&d, v.size() * sizeof(T) + 1));
  CUDACHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
static std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> v(n);
  CUDACHECK(cudaStreamSynchronize(g_stream));
  CUDACHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

static void report(const char* name, bool ok) { std::printf("ok_%s=%d\n", name, ok ? 1 : 0); }

static uint16_t to_bf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>(b >> 16);  // exact for the small integers used here
}
static float from_bf16(uint16_t h) {
  uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

static void run_collectives() {
  const int n = 1 << 12, R = g_nranks, r = g_rank;
  {  // float32 sum, in place
    std::vector<float> v(n);
    for (int i = 0; i < n; ++i) v[i] = static_cast<float>(r + 1) * i;
    float* d = to_device(v);
    NCCLCHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream));
    auto out = to_host(d, n);
    bool ok = true;
    for (int i = 0; i < n; ++i) ok &= out[i] == static_cast<float>(R * (R + 1) / 2) * i;
    report("allreduce_f32_sum", ok);
  }
  {  // float64 max / int32 min / int64 prod / float32 avg, out of place
    std::vector<double> v(n, static_cast<double>(r) + 0.5);
    double* d = to_device(v);
    double* o = to_device(std::vector<double>(n, 0));
    NCCLCHECK(ncclAllReduce(d, o, n, ncclFloat64, ncclMax, g_comm, g_stream));
    report("allreduce_f64_max", to_host(o, n)[n - 1] == R - 0.5);
    std::vector<int32_t> iv(n, 10 + r);
    int32_t* di = to_device(iv);
    NCCLCHECK(ncclAllReduce(di, di, n, ncclInt32, ncclMin, g_comm, g_stream));
    report("allreduce_i32_min", to_host(di, n)[7] == 10);
    std::vector<int64_t> lv(n, 2 + r);
    int64_t* dl = to_device(lv);
    NCCLCHECK(ncclAllReduce(dl, dl, n, ncclInt64, ncclProd, g_comm, g_stream));
    int64_t prod = 1;
    for (int k = 0; k < R; ++k) prod *= 2 + k;
    report("allreduce_i64_prod", to_host(dl, n)[3] == prod);
    std::vector<float> fv(n, static_cast<float>(2 * r));
    float* df = to_device(fv);
    NCCLCHECK(ncclAllReduce(df, df, n, ncclFloat32, ncclAvg, g_comm, g_stream));
    report("allreduce_f32_avg", std::fabs(to_host(df, n)[0] - static_cast<float>(R - 1)) < 1e-6f);
    std::vector<uint16_t> bv(n, to_bf16(static_cast<float>(r + 1)));
    uint16_t* db = to_device(bv);
    NCCLCHECK(ncclAllReduce(db, db, n, ncclBfloat16, ncclSum, g_comm, g_stream));
    report("allreduce_bf16_sum", from_bf16(to_host(db, n)[5]) == static_cast<float>(R * (R + 1) / 2));
    std::vector<uint16_t> hv(n, 0x3c00);  // fp16 1.0
    uint16_t* dh = to_device(hv);
    NCCLCHECK(ncclAllReduce(dh, dh, n, ncclFloat16, ncclSum, g_comm, g_stream));
    const uint16_t expect_h = R == 2 ? 0x4000 : (R == 3 ? 0x4200 : 0x4400);  // 2.0, 3.0, 4.0
    report("allreduce_f16_sum", to_host(dh, n)[9] == expect_h);
  }
  {  // broadcast from the last rank, reduce to rank 0
    std::vector<int32_t> v(n, r == R - 1 ? 42 : -1);
    int32_t* d = to_device(v);
    NCCLCHECK(ncclBroadcast(d, d, n, ncclInt32, R - 1, g_comm, g_stream));
    report("broadcast", to_host(d, n)[n - 1] == 42);
    std::vector<int32_t> w(n, r + 1);
    int32_t* s = to_device(w);
    int32_t* o = to_device(std::vector<int32_t>(n, 0));
    NCCLCHECK(ncclReduce(s, o, n, ncclInt32, ncclSum, 0, g_comm, g_stream));
    auto out = to_host(o, n);
    report("reduce", r == 0 ? out[1] == R * (R + 1) / 2 : out[1] == 0);
  }
  {  // allgather and reducescatter
    const int c = 16;
    std::vector<int32_t> v(c, r * 100);
    int32_t* s = to_device(v);
    int32_t* o = to_device(std::vector<int32_t>(static_cast<size_t>(c) * R, -1));
    NCCLCHECK(ncclAllGather(s, o, c, ncclInt32, g_comm, g_stream));
    auto out = to_host(o, static_cast<size_t>(c) * R);
    bool ok = true;
    for (int k = 0; k < R; ++k) ok &= out[static_cast<size_t>(k) * c + 3] == k * 100;
    report("allgather", ok);
    std::vector<float> big(static_cast<size_t>(c) * R);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<float>(i);
    float* bs = to_device(big);
    float* bo = to_device(std::vector<float>(c, 0));
    NCCLCHECK(ncclReduceScatter(bs, bo, c, ncclFloat32, ncclSum, g_comm, g_stream));
    report("reducescatter", to_host(bo, c)[2] == static_cast<float>(R * (r * c + 2)));
  }
  {  // gather to the last rank
    const int c = 8;
    std::vector<int32_t> v(c, r + 7);
    int32_t* s = to_device(v);
    int32_t* o = to_device(std::vector<int32_t>(static_cast<size_t>(c) * R, -1));
    NCCLCHECK(ncclGather(s, o, c, ncclInt32, R - 1, g_comm, g_stream));
    auto out = to_host(o, static_cast<size_t>(c) * R);
    bool ok = true;
    for (int k = 0; k < R; ++k) ok &= out[static_cast<size_t>(k) * c + 1] == (r == R - 1 ? k + 7 : -1);
    report("gather", ok);
  }
  {  // ring exchange with send/recv in a group
    std::vector<int32_t> v(n, r);
    int32_t* s = to_device(v);
    int32_t* o = to_device(std::vector<int32_t>(n, -1));
    NCCLCHECK(ncclGroupStart());
    NCCLCHECK(ncclSend(s, n, ncclInt32, (r + 1) % R, g_comm, g_stream));
    NCCLCHECK(ncclRecv(o, n, ncclInt32, (r + R - 1) % R, g_comm, g_stream));
    NCCLCHECK(ncclGroupEnd());
    report("sendrecv_ring", to_host(o, n)[n / 2] == (r + R - 1) % R);
  }
  int count = 0, rank = -1, dev = -1;
  NCCLCHECK(ncclCommCount(g_comm, &count));
  NCCLCHECK(ncclCommUserRank(g_comm, &rank));
  NCCLCHECK(ncclCommCuDevice(g_comm, &dev));
  report("comm_queries", count == R && rank == r && dev == 0);
}

// Polls `ev` for `window_ms`; returns its last status (cudaErrorNotReady if it never completed).
static cudaError_t poll_event(cudaEvent_t ev, int window_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(window_ms);
  cudaError_t st = cudaEventQuery(ev);
  while (st == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) st = cudaEventQuery(ev);
  return st;
}

static void run_stop(int window_ms) {
  const int n = 1024;
  float* d = to_device(std::vector<float>(n, 1.0f));
  NCCLCHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream));
  CUDACHECK(cudaStreamSynchronize(g_stream));
  std::printf("phase1_done=1\n");
  std::fflush(stdout);
  std::string line;
  std::getline(std::cin, line);  // the test sends "go" once it has stopped a peer
  cudaEvent_t ev;
  CUDACHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  NCCLCHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream));
  CUDACHECK(cudaEventRecord(ev, g_stream));
  std::printf("event_during_hang=%s\n", cudaGetErrorName(poll_event(ev, window_ms)));
  std::printf("stream_during_hang=%s\n", cudaGetErrorName(cudaStreamQuery(g_stream)));
  std::fflush(stdout);
  NCCLCHECK(ncclCommAbort(g_comm));
  std::printf("event_after_abort=%s\n", cudaGetErrorName(cudaEventSynchronize(ev)));
}

static void run_inject(int window_ms) {
  const int n = 256;
  float* d = to_device(std::vector<float>(n, 1.0f));
  cudaEvent_t ev[3];
  // All events first: after an injected sticky fault (raised when the stream runs call 2, which
  // may be before this thread gets here) every runtime call fails, cudaEventCreate included.
  for (int i = 0; i < 3; ++i) CUDACHECK(cudaEventCreate(&ev[i]));
  for (int i = 0; i < 3; ++i) {
    ncclResult_t r = ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream);
    std::printf("call%d=%d\n", i + 1, static_cast<int>(r));
    std::fflush(stdout);
    cudaEventRecord(ev[i], g_stream);
  }
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(window_ms);
  cudaError_t st[3];
  do {  // newest first: once a later event is complete, the earlier ones must be too
    for (int i = 2; i >= 0; --i) st[i] = cudaEventQuery(ev[i]);
  } while (st[2] == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline);
  for (int i = 0; i < 3; ++i) std::printf("event%d=%s\n", i + 1, cudaGetErrorName(st[i]));
  ncclResult_t async = ncclSuccess;
  NCCLCHECK(ncclCommGetAsyncError(g_comm, &async));
  std::printf("async=%d\n", static_cast<int>(async));
  void* probe = nullptr;
  std::printf("malloc_after=%s\n", cudaGetErrorName(cudaMalloc(&probe, 64)));
  std::fflush(stdout);
  NCCLCHECK(ncclCommAbort(g_comm));
}

static void run_split() {
  ncclComm_t sub = nullptr;
  NCCLCHECK(ncclCommSplit(g_comm, g_rank % 2, -g_rank, &sub, nullptr));
  int count = 0, rank = -1;
  NCCLCHECK(ncclCommCount(sub, &count));
  NCCLCHECK(ncclCommUserRank(sub, &rank));
  std::printf("split_count=%d\n", count);
  std::printf("split_rank=%d\n", rank);
  std::vector<int32_t> v(8, g_rank);
  int32_t* d = to_device(v);
  NCCLCHECK(ncclAllReduce(d, d, 8, ncclInt32, ncclSum, sub, g_stream));
  std::printf("split_sum=%d\n", to_host(d, 8)[0]);
  ncclComm_t none = reinterpret_cast<ncclComm_t>(1);
  NCCLCHECK(ncclCommSplit(g_comm, g_rank == 0 ? 0 : NCCL_SPLIT_NOCOLOR, 0, &none, nullptr));
  std::printf("nocolor_null=%d\n", g_rank == 0 ? none != nullptr : none == nullptr);
  NCCLCHECK(ncclCommDestroy(sub));
  if (none) NCCLCHECK(ncclCommDestroy(none));
  NCCLCHECK(ncclCommDestroy(g_comm));
}

static void run_bench(int mib) {
  const size_t n = static_cast<size_t>(mib) << 18;  // floats
  float* d = to_device(std::vector<float>(n, 1.0f));
  NCCLCHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream));
  CUDACHECK(cudaStreamSynchronize(g_stream));
  cudaEvent_t t0, t1;
  CUDACHECK(cudaEventCreate(&t0));
  CUDACHECK(cudaEventCreate(&t1));
  const int iters = 5;
  CUDACHECK(cudaEventRecord(t0, g_stream));
  for (int i = 0; i < iters; ++i) NCCLCHECK(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, g_comm, g_stream));
  CUDACHECK(cudaEventRecord(t1, g_stream));
  CUDACHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CUDACHECK(cudaEventElapsedTime(&ms, t0, t1));
  std::printf("ms_per_iter=%.3f\n", ms / iters);
  NCCLCHECK(ncclCommDestroy(g_comm));
}

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s collectives|stop|inject <rank> <nranks> [uid-hex] [window-ms]\n", argv[0]);
    return 64;
  }
  const std::string mode = argv[1];
  g_rank = std::atoi(argv[2]);
  g_nranks = std::atoi(argv[3]);
  const int window_ms = argc > 5 ? std::atoi(argv[5]) : 1500;
  ncclUniqueId id;
  if (!exchange_unique_id(g_rank, argc, argv, &id)) return 64;
  CUDACHECK(cudaSetDevice(0));
  CUDACHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  NCCLCHECK(ncclCommInitRank(&g_comm, g_nranks, id, g_rank));
  std::printf("init_done=1\n");
  std::fflush(stdout);
  if (mode == "collectives") {
    run_collectives();
    NCCLCHECK(ncclCommFinalize(g_comm));
    NCCLCHECK(ncclCommDestroy(g_comm));
  } else if (mode == "stop") {
    run_stop(window_ms);
  } else if (mode == "split") {
    run_split();
  } else if (mode == "bench") {
    run_bench(window_ms);
  } else if (mode == "inject") {
    run_inject(window_ms);
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 64;
  }
  std::printf("exit_clean=1\n");
  std::fflush(stdout);
  return 0;
}
