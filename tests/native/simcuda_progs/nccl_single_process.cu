// Several ranks in one process (SIMCUDA_DEVICES=2): ncclCommInitAll with a grouped allreduce issued
// from one thread, then non-blocking ncclCommInitRankConfig of two ranks from one thread.
// Also __device__ symbols (cudaMemcpyToSymbol / cudaGetSymbolAddress).
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdio>
#include <vector>

__device__ int g_counter[4];

#define CHECK(call)                                                                 \
  do {                                                                              \
    auto e_ = (call);                                                               \
    if (static_cast<int>(e_) != 0) {                                                \
      std::printf("FAIL line %d %s: %d\n", __LINE__, #call, static_cast<int>(e_));  \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

static int allreduce_pair(ncclComm_t* comms, cudaStream_t* streams, float* out) {
  float* buf[2];
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaSetDevice(i));
    CHECK(cudaMalloc(&buf[i], 64 * sizeof(float)));
    std::vector<float> v(64, static_cast<float>(i + 1));
    CHECK(cudaMemcpy(buf[i], v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice));
  }
  CHECK(ncclGroupStart());
  for (int i = 0; i < 2; ++i) CHECK(ncclAllReduce(buf[i], buf[i], 64, ncclFloat32, ncclSum, comms[i], streams[i]));
  CHECK(ncclGroupEnd());
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaSetDevice(i));
    CHECK(cudaStreamSynchronize(streams[i]));
    CHECK(cudaMemcpy(&out[i], buf[i] + 63, sizeof(float), cudaMemcpyDeviceToHost));
  }
  return 0;
}

int main() {
  cudaStream_t streams[2];
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaSetDevice(i));
    CHECK(cudaStreamCreate(&streams[i]));
  }
  ncclComm_t comms[2];
  const int devs[2] = {0, 1};
  CHECK(ncclCommInitAll(comms, 2, devs));
  int dev1 = -1;
  CHECK(ncclCommCuDevice(comms[1], &dev1));
  std::printf("initall_device1=%d\n", dev1);
  float out[2] = {0, 0};
  if (allreduce_pair(comms, streams, out)) return 1;
  std::printf("initall_sum=%g,%g\n", out[0], out[1]);
  for (int i = 0; i < 2; ++i) {
    CHECK(ncclCommFinalize(comms[i]));
    CHECK(ncclCommDestroy(comms[i]));
  }

  // Non-blocking init: both ranks from this one thread, then poll until ready (bounded).
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  for (int i = 0; i < 2; ++i) {
    CHECK(cudaSetDevice(i));
    ncclResult_t r = ncclCommInitRankConfig(&comms[i], 2, id, i, &config);
    std::printf("nonblocking_init_%d=%d\n", i, static_cast<int>(r));
  }
  ncclResult_t state[2] = {ncclInProgress, ncclInProgress};
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while ((state[0] == ncclInProgress || state[1] == ncclInProgress) && std::chrono::steady_clock::now() < deadline)
    for (int i = 0; i < 2; ++i) CHECK(ncclCommGetAsyncError(comms[i], &state[i]));
  std::printf("nonblocking_ready=%d,%d\n", static_cast<int>(state[0]), static_cast<int>(state[1]));
  if (allreduce_pair(comms, streams, out)) return 1;
  std::printf("nonblocking_sum=%g,%g\n", out[0], out[1]);
  for (int i = 0; i < 2; ++i) CHECK(ncclCommAbort(comms[i]));

  // A non-blocking init whose peer never shows up stays in progress; ncclCommAbort ends it.
  ncclUniqueId lonely;
  CHECK(ncclGetUniqueId(&lonely));
  ncclComm_t half;
  CHECK(cudaSetDevice(0));
  std::printf("lonely_init=%d\n", static_cast<int>(ncclCommInitRankConfig(&half, 2, lonely, 0, &config)));
  ncclResult_t lonely_state = ncclSuccess;
  CHECK(ncclCommGetAsyncError(half, &lonely_state));
  std::printf("lonely_state=%d\n", static_cast<int>(lonely_state));
  std::printf("lonely_abort=%d\n", static_cast<int>(ncclCommAbort(half)));

  // __device__ symbols.
  CHECK(cudaSetDevice(0));
  const int init[4] = {5, 6, 7, 8};
  CHECK(cudaMemcpyToSymbol(g_counter, init, sizeof(init)));
  int* addr = nullptr;
  CHECK(cudaGetSymbolAddress(reinterpret_cast<void**>(&addr), g_counter));
  int back = 0;
  CHECK(cudaMemcpy(&back, addr + 2, sizeof(int), cudaMemcpyDeviceToHost));
  std::printf("symbol_value=%d\n", back);
  cudaPointerAttributes a{};
  CHECK(cudaPointerGetAttributes(&a, addr));
  std::printf("symbol_is_device=%d\n", a.type == cudaMemoryTypeDevice ? 1 : 0);
  std::printf("bad_symbol=%s\n", cudaGetErrorName(cudaMemcpyToSymbol(init, init, 4)));
  std::printf("done=1\n");
  return 0;
}
