// Two pipeline stages over NCCL point-to-point, for libjit.so's send log (SWIFT logging at the NCCL
// level). Usage: pipeline_sends pipeline <rank> 2 [uid-hex] [drop-through]
// Per iteration 1..ITERS and micro-batch 0..MB-1: stage 0 fills an activation (a kernel), sends
// it, and overwrites the buffer at once (the log must hold the bytes sent, not later ones); stage 1
// receives it, checks it, sends back the gradient -activation and overwrites that buffer too;
// stage 0 checks the gradient. Before its first send, stage 0 enqueues a ~200 ms kernel and
// reports whether the stream was still busy right after ncclSend returned (logging must not wait
// for the stream). The send log is reached through libjit.so's C ABI (jitckpt_api_v1, found with
// dlsym: absent when libjit.so is not preloaded). At the end: flush, then drop the chunks of
// iterations <= drop-through (0: none). Mode orphan: stage 1 exits at once and stage 0's one send
// never completes; stage 0 flushes the log while the send is still pending. Mode orphan_hang: stage 0
// blocks in cudaStreamSynchronize behind that send instead (libjit.so detects the hang). $PIPE_FIRST_ITER: the
// first iteration this process runs (a survivor resuming after a replacement). Prints key=value
// lines, the last one libjit.so's status JSON.
#include <cuda_runtime.h>

__global__ void fill(float* out, float value, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = value + 0.001f * static_cast<float>(i);
}

__global__ void negate(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = -in[i];
}

__global__ void spin(long long iterations, float* sink) {
  float acc = 0.0f;
  for (long long k = 0; k < iterations; ++k) acc += 1e-9f * static_cast<float>(k & 7);
  *sink = acc;
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(fill)
SIMCUDA_EXPORT_KERNEL(negate)
SIMCUDA_EXPORT_KERNEL(spin)
#else
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jitckpt/jit_abi.h"
#include "nccl_rank_setup.h"

constexpr int ITERS = 4, MB = 2, N = 1000, BIG = 8 << 20;

static float expected(int it, int mb, int i) { return static_cast<float>(100 * it + 10 * mb) + 0.001f * i; }

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s pipeline <rank> 2 [uid-hex] [drop-through]\n", argv[0]);
    return 64;
  }
  const int rank = std::atoi(argv[2]), nranks = std::atoi(argv[3]);
  const long long drop_through = argc > 5 ? std::atoll(argv[5]) : 0;
  ncclUniqueId id;
  if (!exchange_unique_id(rank, argc, argv, &id)) return 64;
  auto get_api = reinterpret_cast<const jitckpt_api* (*)()>(dlsym(RTLD_DEFAULT, "jitckpt_api_v1"));
  const jitckpt_api* api = get_api != nullptr ? get_api() : nullptr;
  if (api != nullptr && api->abi_version != JITCKPT_ABI_VERSION) api = nullptr;
  std::printf("libjit=%d\n", api != nullptr);

  cudaStream_t stream;
  ncclComm_t comm;
  CUDACHECK(cudaSetDevice(0));
  CUDACHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
  float *act = nullptr, *grad = nullptr, *sink = nullptr;
  CUDACHECK(cudaMalloc(&act, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&grad, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&sink, sizeof(float)));
  const std::string mode = argv[1];
  if (mode == "orphan" || mode == "orphan_hang") {
    // The receiver is gone before the message: the send never completes, yet it must be in the
    // log (a replacement receiver will need exactly this message).
    if (rank == 1) {  // alive, but never receives (the test kills it)
      std::printf("waiting=1\n");
      std::fflush(stdout);
      for (;;) pause();
    }
    // Larger than what the sockets can buffer, so the send cannot complete without a receiver.
    float* big = nullptr;
    CUDACHECK(cudaMalloc(&big, BIG * sizeof(float)));
    fill<<<(BIG + 255) / 256, 256, 0, stream>>>(big, 100.0f, BIG);
    if (api != nullptr) api->set_log_context(1, 0, "activation");
    NCCLCHECK(ncclSend(big, BIG, ncclFloat32, 1, comm, stream));
    fill<<<(BIG + 255) / 256, 256, 0, stream>>>(big, -1.0f, BIG);
    if (mode == "orphan_hang") {  // block behind the hung send: libjit.so's watchdog takes over
      std::printf("blocking=1\n");
      std::fflush(stdout);
      cudaStreamSynchronize(stream);
    }
    char err[512] = {0};
    std::printf("flush=%d\n", api != nullptr ? api->flush_send_log(20.0, err, sizeof err) : -2);
    std::printf("send_pending=%d\n", cudaStreamQuery(stream) == cudaErrorNotReady);
    std::printf("done=1\n");
    std::fflush(stdout);
    std::_Exit(0);  // no teardown of a communicator whose peer is gone
  }
  std::vector<float> host(N);
  int bad = 0, busy_after_send = -1;
  // A survivor of a failure continues where it was; a replacement starts over (its receives up to
  // the survivors' iteration come from the logs when JITCKPT_RECV_REPLAY_* are set).
  const char* first = std::getenv("PIPE_FIRST_ITER");
  for (int it = first != nullptr ? std::atoi(first) : 1; it <= ITERS; ++it) {
    for (int mb = 0; mb < MB; ++mb) {
      if (rank == 0) {
        fill<<<(N + 255) / 256, 256, 0, stream>>>(act, static_cast<float>(100 * it + 10 * mb), N);
        if (it == 1 && mb == 0) spin<<<1, 1, 0, stream>>>(200LL * 1000 * 1000, sink);
        if (api != nullptr) api->set_log_context(it, mb, "activation");
        NCCLCHECK(ncclSend(act, N, ncclFloat32, 1, comm, stream));
        if (it == 1 && mb == 0) busy_after_send = cudaStreamQuery(stream) == cudaErrorNotReady;
        fill<<<(N + 255) / 256, 256, 0, stream>>>(act, -1.0f, N);  // the next write to the buffer
        if (api != nullptr) api->set_log_context(it, mb, "gradient");
        NCCLCHECK(ncclRecv(grad, N, ncclFloat32, 1, comm, stream));
        CUDACHECK(cudaMemcpyAsync(host.data(), grad, N * sizeof(float), cudaMemcpyDeviceToHost, stream));
        CUDACHECK(cudaStreamSynchronize(stream));
        for (int i = 0; i < N; ++i) bad += host[i] != -expected(it, mb, i);
      } else {
        if (api != nullptr) api->set_log_context(it, mb, "activation");
        NCCLCHECK(ncclRecv(act, N, ncclFloat32, 0, comm, stream));
        CUDACHECK(cudaMemcpyAsync(host.data(), act, N * sizeof(float), cudaMemcpyDeviceToHost, stream));
        CUDACHECK(cudaStreamSynchronize(stream));
        for (int i = 0; i < N; ++i) bad += host[i] != expected(it, mb, i);
        negate<<<(N + 255) / 256, 256, 0, stream>>>(act, grad, N);
        if (api != nullptr) api->set_log_context(it, mb, "gradient");
        NCCLCHECK(ncclSend(grad, N, ncclFloat32, 0, comm, stream));
        fill<<<(N + 255) / 256, 256, 0, stream>>>(grad, -2.0f, N);
      }
    }
  }
  CUDACHECK(cudaStreamSynchronize(stream));
  std::printf("mismatches=%d\n", bad);
  if (rank == 0) std::printf("busy_after_send=%d\n", busy_after_send);
  if (api != nullptr) {
    char err[512] = {0};
    std::printf("flush=%d\n", api->flush_send_log(30.0, err, sizeof err));
    if (err[0] != '\0') std::printf("flush_error=%s\n", err);
    if (drop_through > 0) std::printf("dropped=%d\n", api->drop_send_logs_through(drop_through));
    char status[8192];
    api->status_json(status, sizeof status);
    std::printf("status=%s\n", status);
  }
  NCCLCHECK(ncclCommDestroy(comm));
  std::printf("done=1\n");
  std::fflush(stdout);
  return 0;
}
#endif
