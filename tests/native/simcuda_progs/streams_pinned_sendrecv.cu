// Streams, events, pinned memory and NCCL point-to-point in one program: a test program for proxy
// mode (every CUDA/NCCL call forwarded to a device proxy must give bitwise the same results as a
// direct run on simcuda). Usage: streams_pinned_sendrecv ring <rank> <nranks> [uid-hex] [steps] [marks]
// (steps: default 5; 0 also means 5). Rank 0 creates the NCCL unique id and prints "uid=<hex>".
// "marks": each step starts with jitckpt_mark_minibatch() and calls jitckpt_mark_optimizer_step()
// before `accumulate`, the only kernel that changes a buffer kept across steps (jitckpt/marks.h).
//
// Per step s, with all inputs generated from (rank, step, index):
//   host    writes the step's input into pinned memory (cudaHostAlloc), only after the previous
//           upload has completed (cudaEventSynchronize)
//   copy    cudaMemcpyAsync pinned -> device, event `uploaded`
//   compute waits for `uploaded`; cudaMemsetAsync, kernels mix (struct by value) and stamp
//           (long long), shift (float); event `computed`
//   comm    waits for `computed`; cudaMemsetAsync of the receive buffer, ring exchange in an NCCL
//           group (send to rank+1, receive from rank-1), float allreduce; event `communicated`
//   legacy  the legacy default stream waits for `communicated`; kernel accumulate; event `accumulated`
//   copy    waits for `accumulated`; cudaMemcpyAsync device -> pinned (cudaMallocHost) of the received
//           and reduced buffers; the host polls cudaEventQuery, then cudaStreamSynchronize, and
//           checks both against its own reference before the next step reuses the buffers.
// The accumulator is uploaded and read back with pageable synchronous cudaMemcpy. All float values
// are multiples of 1/4 well below 2^20, so every sum is exact in any order: the results are the
// same bitwise on any device. Prints key=value lines: the digests (FNV-1a 64 over the bytes of the
// final buffers copied back), mismatch counts and ok=1; exits 1 if anything differs from the
// reference, 2/3 on a failed CUDA/NCCL call.
#include <cuda_runtime.h>

struct MixParams {  // passed by value: 16 bytes, 8-byte aligned, mixed member types
  int mul;
  float scale;
  long long offset;
};

// send[i] = in[i] * mul + offset term; work[i] = in[i] * scale (the float path to the allreduce)
__global__ void mix(const int* in, int* send, float* work, MixParams p, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    send[i] = in[i] * p.mul + static_cast<int>(p.offset >> 33) * 1000 + static_cast<int>(p.offset & 0xffff);
    work[i] = static_cast<float>(in[i]) * p.scale;
  }
}

// Uses bits above 32 of salt, so the whole 8-byte argument has to arrive.
__global__ void stamp(int* send, long long salt, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) send[i] += static_cast<int>((salt >> (i % 40)) & 0x3f);
}

__global__ void shift(float* work, float delta, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) work[i] += delta;
}

__global__ void accumulate(long long* acc, const int* recv, const float* sum, long long weight, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) acc[i] += static_cast<long long>(recv[i]) * weight + static_cast<long long>(4.0f * sum[i]);
}

#ifdef SIMCUDA_HOST_KERNELS
SIMCUDA_EXPORT_KERNEL(mix)
SIMCUDA_EXPORT_KERNEL(stamp)
SIMCUDA_EXPORT_KERNEL(shift)
SIMCUDA_EXPORT_KERNEL(accumulate)
#else
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "jitckpt/marks.h"
#include "nccl_rank_setup.h"

constexpr int N = 3001;  // not a multiple of the block size
constexpr int BLOCK = 128, GRID = (N + BLOCK - 1) / BLOCK;
constexpr int DEFAULT_STEPS = 5;

// ---- the program's inputs and the host reference of every kernel ----------------------------------

static int input(int rank, int step, int i) {
  return static_cast<int>(((rank + 1) * 7919LL + (step + 1) * 104729LL + i * 31LL) % 10007) - 5000;
}
static MixParams mix_params(int rank, int step) {
  return MixParams{2 + (rank + step) % 3, step % 2 == 0 ? 0.5f : 0.25f,
                   (static_cast<long long>(rank + 1) << 33) + 1000LL * step + 7};
}
static long long salt(int rank, int step) { return (rank + 1) * 0x100000001LL * (step + 1) + 12345; }
static float delta(int rank, int step) { return 0.25f * static_cast<float>(step + 1) + static_cast<float>(rank); }
static long long acc_init(int rank, int i) { return rank * 1000003LL + i; }

static int ref_send(int rank, int step, int i) {
  const MixParams p = mix_params(rank, step);
  int v = input(rank, step, i) * p.mul + static_cast<int>(p.offset >> 33) * 1000 + static_cast<int>(p.offset & 0xffff);
  return v + static_cast<int>((salt(rank, step) >> (i % 40)) & 0x3f);
}
static float ref_work(int rank, int step, int i) {
  return static_cast<float>(input(rank, step, i)) * mix_params(rank, step).scale + delta(rank, step);
}
static float ref_sum(int nranks, int step, int i) {
  float s = 0.0f;
  for (int r = 0; r < nranks; ++r) s += ref_work(r, step, i);  // exact: the order does not matter
  return s;
}

static uint64_t fnv1a(const void* data, size_t bytes, uint64_t h = 0xcbf29ce484222325ULL) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t k = 0; k < bytes; ++k) h = (h ^ p[k]) * 0x100000001b3ULL;
  return h;
}

// cudaEventQuery until the event is no longer cudaErrorNotReady (bounded: 120 s); its last status.
static cudaError_t poll_event(cudaEvent_t ev) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  cudaError_t st = cudaEventQuery(ev);
  while (st == cudaErrorNotReady && std::chrono::steady_clock::now() < deadline) st = cudaEventQuery(ev);
  return st;
}

int main(int argc, char** argv) {
  if (argc < 4 || std::string(argv[1]) != "ring") {
    std::fprintf(stderr, "usage: %s ring <rank> <nranks> [uid-hex] [steps]\n", argv[0]);
    return 64;
  }
  // "ring env env <uid-file> [steps]": rank and size from a launcher's RANK and WORLD_SIZE.
  const bool from_env = std::string(argv[2]) == "env";
  const char* env_rank = std::getenv("RANK");
  const char* env_world = std::getenv("WORLD_SIZE");
  if (from_env && (!env_rank || !env_world || argc < 5)) {
    std::fprintf(stderr, "ring env env <uid-file> needs RANK and WORLD_SIZE in the environment\n");
    return 64;
  }
  const int rank = std::atoi(from_env ? env_rank : argv[2]), nranks = std::atoi(from_env ? env_world : argv[3]);
  const int steps = argc > 5 && std::atoi(argv[5]) > 0 ? std::atoi(argv[5]) : DEFAULT_STEPS;
  const int next = (rank + 1) % nranks, prev = (rank + nranks - 1) % nranks;
  ncclUniqueId id;
  if (!(from_env ? exchange_unique_id_file(rank, argv[4], &id) : exchange_unique_id(rank, argc, argv, &id))) return 64;

  CUDACHECK(cudaSetDevice(0));
  cudaStream_t copy, compute, comm_stream;  // and the legacy default stream (0)
  CUDACHECK(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  CUDACHECK(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  CUDACHECK(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
  cudaEvent_t uploaded, computed, communicated, accumulated, downloaded;
  for (cudaEvent_t* ev : {&uploaded, &computed, &communicated, &accumulated, &downloaded})
    CUDACHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
  std::printf("init_done=1\n");
  std::fflush(stdout);

  int* h_in = nullptr;     // pinned, cudaHostAlloc: the step's input
  int* h_recv = nullptr;   // pinned, cudaMallocHost: the received buffer, read back
  float* h_sum = nullptr;  // pinned, cudaMallocHost: the allreduce result, read back
  CUDACHECK(cudaHostAlloc(reinterpret_cast<void**>(&h_in), N * sizeof(int), cudaHostAllocDefault));
  CUDACHECK(cudaMallocHost(reinterpret_cast<void**>(&h_recv), N * sizeof(int)));
  CUDACHECK(cudaMallocHost(reinterpret_cast<void**>(&h_sum), N * sizeof(float)));
  int *d_in = nullptr, *d_send = nullptr, *d_recv = nullptr;
  float *d_work = nullptr, *d_sum = nullptr;
  long long* d_acc = nullptr;
  CUDACHECK(cudaMalloc(&d_in, N * sizeof(int)));
  CUDACHECK(cudaMalloc(&d_send, N * sizeof(int)));
  CUDACHECK(cudaMalloc(&d_recv, N * sizeof(int)));
  CUDACHECK(cudaMalloc(&d_work, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&d_sum, N * sizeof(float)));
  CUDACHECK(cudaMalloc(&d_acc, N * sizeof(long long)));

  std::vector<long long> acc(N);  // pageable: synchronous copies both ways
  for (int i = 0; i < N; ++i) acc[i] = acc_init(rank, i);
  CUDACHECK(cudaMemcpy(d_acc, acc.data(), N * sizeof(long long), cudaMemcpyHostToDevice));

  std::vector<long long> ref_acc(acc);
  long recv_mismatches = 0, sum_mismatches = 0, event_not_success = 0;
  const bool marks = argc > 6 && std::string(argv[6]) == "marks";
  for (int s = 0; s < steps; ++s) {
    if (marks) jitckpt_minibatch();
    // The previous upload has read h_in (a no-op wait in step 0: the event was never recorded).
    CUDACHECK(cudaEventSynchronize(uploaded));
    for (int i = 0; i < N; ++i) h_in[i] = input(rank, s, i);
    CUDACHECK(cudaMemcpyAsync(d_in, h_in, N * sizeof(int), cudaMemcpyHostToDevice, copy));
    CUDACHECK(cudaEventRecord(uploaded, copy));

    CUDACHECK(cudaStreamWaitEvent(compute, uploaded, 0));
    CUDACHECK(cudaMemsetAsync(d_send, 0x5a, N * sizeof(int), compute));  // overwritten by mix
    mix<<<GRID, BLOCK, 0, compute>>>(d_in, d_send, d_work, mix_params(rank, s), N);
    CUDACHECK(cudaGetLastError());
    stamp<<<GRID, BLOCK, 0, compute>>>(d_send, salt(rank, s), N);
    CUDACHECK(cudaGetLastError());
    shift<<<GRID, BLOCK, 0, compute>>>(d_work, delta(rank, s), N);
    CUDACHECK(cudaGetLastError());
    CUDACHECK(cudaEventRecord(computed, compute));

    CUDACHECK(cudaStreamWaitEvent(comm_stream, computed, 0));
    CUDACHECK(cudaMemsetAsync(d_recv, 0xff, N * sizeof(int), comm_stream));  // must be overwritten
    CUDACHECK(cudaMemsetAsync(d_sum, 0, N * sizeof(float), comm_stream));
    NCCLCHECK(ncclGroupStart());
    NCCLCHECK(ncclSend(d_send, N, ncclInt32, next, comm, comm_stream));
    NCCLCHECK(ncclRecv(d_recv, N, ncclInt32, prev, comm, comm_stream));
    NCCLCHECK(ncclGroupEnd());
    NCCLCHECK(ncclAllReduce(d_work, d_sum, N, ncclFloat32, ncclSum, comm, comm_stream));
    CUDACHECK(cudaEventRecord(communicated, comm_stream));

    CUDACHECK(cudaStreamWaitEvent(0, communicated, 0));  // legacy stream: no implicit order with these
    if (marks) jitckpt_optimizer_step();
    accumulate<<<GRID, BLOCK>>>(d_acc, d_recv, d_sum, static_cast<long long>(s + 1) << 20, N);
    CUDACHECK(cudaGetLastError());
    CUDACHECK(cudaEventRecord(accumulated, 0));

    CUDACHECK(cudaStreamWaitEvent(copy, accumulated, 0));
    CUDACHECK(cudaMemcpyAsync(h_recv, d_recv, N * sizeof(int), cudaMemcpyDeviceToHost, copy));
    CUDACHECK(cudaEventRecord(downloaded, copy));
    CUDACHECK(cudaMemcpyAsync(h_sum, d_sum, N * sizeof(float), cudaMemcpyDeviceToHost, copy));
    event_not_success += poll_event(downloaded) != cudaSuccess;
    CUDACHECK(cudaStreamSynchronize(copy));

    for (int i = 0; i < N; ++i) {
      recv_mismatches += h_recv[i] != ref_send(prev, s, i);
      const float sum = ref_sum(nranks, s, i);
      sum_mismatches += std::memcmp(&h_sum[i], &sum, sizeof(float)) != 0;
      ref_acc[i] += static_cast<long long>(ref_send(prev, s, i)) * (static_cast<long long>(s + 1) << 20) +
                    static_cast<long long>(4.0f * sum);
    }
  }

  CUDACHECK(cudaDeviceSynchronize());
  CUDACHECK(cudaMemcpy(acc.data(), d_acc, N * sizeof(long long), cudaMemcpyDeviceToHost));
  std::vector<int> send(N);
  CUDACHECK(cudaMemcpy(send.data(), d_send, N * sizeof(int), cudaMemcpyDeviceToHost));
  long acc_mismatches = 0, send_mismatches = 0;
  for (int i = 0; i < N; ++i) {
    acc_mismatches += acc[i] != ref_acc[i];
    send_mismatches += send[i] != ref_send(rank, steps - 1, i);
  }

  // Final device buffers: the accumulator and the last step's sent, received and reduced buffers.
  uint64_t digest = fnv1a(acc.data(), N * sizeof(long long));
  digest = fnv1a(send.data(), N * sizeof(int), digest);
  digest = fnv1a(h_recv, N * sizeof(int), digest);
  digest = fnv1a(h_sum, N * sizeof(float), digest);
  std::printf("rank=%d\nnranks=%d\nsteps=%d\n", rank, nranks, steps);
  std::printf("acc_mismatches=%ld\nsend_mismatches=%ld\nrecv_mismatches=%ld\nsum_mismatches=%ld\n", acc_mismatches,
              send_mismatches, recv_mismatches, sum_mismatches);
  std::printf("event_not_success=%ld\n", event_not_success);
  std::printf("acc_first=%lld\nacc_last=%lld\n", acc[0], acc[N - 1]);
  std::printf("digest_sum=%016llx\n", static_cast<unsigned long long>(fnv1a(h_sum, N * sizeof(float))));
  std::printf("digest=%016llx\n", static_cast<unsigned long long>(digest));
  // Kernel attributes (what torch asks of its kernels): the same answers directly and via a proxy.
  cudaFuncAttributes attr{};
  CUDACHECK(cudaFuncGetAttributes(&attr, mix));
  CUDACHECK(cudaFuncSetAttribute(mix, cudaFuncAttributeMaxDynamicSharedMemorySize, 1024));
  int blocks_per_sm = 0;
  CUDACHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, accumulate, 128, 0));
  std::printf("attr_max_threads=%d\nattr_num_regs=%d\noccupancy=%d\n", attr.maxThreadsPerBlock, attr.numRegs,
              blocks_per_sm);

  NCCLCHECK(ncclCommDestroy(comm));
  for (cudaEvent_t ev : {uploaded, computed, communicated, accumulated, downloaded}) CUDACHECK(cudaEventDestroy(ev));
  for (cudaStream_t st : {copy, compute, comm_stream}) CUDACHECK(cudaStreamDestroy(st));
  for (void* p : {static_cast<void*>(d_in), static_cast<void*>(d_send), static_cast<void*>(d_recv),
                  static_cast<void*>(d_work), static_cast<void*>(d_sum), static_cast<void*>(d_acc)})
    CUDACHECK(cudaFree(p));
  for (void* p : {static_cast<void*>(h_in), static_cast<void*>(h_recv), static_cast<void*>(h_sum)})
    CUDACHECK(cudaFreeHost(p));
  CUDACHECK(cudaGetLastError());

  const bool ok = acc_mismatches == 0 && send_mismatches == 0 && recv_mismatches == 0 && sum_mismatches == 0 &&
                  event_not_success == 0;
  if (!ok) std::printf("FAIL results differ from the host reference (counts above)\n");
  std::printf("ok=%d\n", ok ? 1 : 0);
  std::fflush(stdout);
  return ok ? 0 : 1;
}
#endif
