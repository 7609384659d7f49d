// Test helper: blocks the calling thread in cudaStreamSynchronize behind a stream that cannot make
// progress, after making libjit.so report a failure from that stream, all inside ONE call so that a
// caller using ctypes.PyDLL holds the GIL for the whole time. The stream is a blocking stream, so
// plain cudaMemcpy (legacy default stream) would wait for it too unless libjit.so redirects it.
// Also: sticky_fault_then, a device fault first seen by a non-synchronizing call (device_fault test).
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>

#include "jitckpt/jit_abi.h"

namespace {

int g_release_fd = -1;  // the host function returns once a byte can be read from it

void CUDART_CB report_and_block(void*) {
  auto get = reinterpret_cast<const jitckpt_api* (*)()>(dlsym(RTLD_DEFAULT, "jitckpt_api_v1"));
  if (get != nullptr) get()->trigger_failure("hang", "gil_blocker: stream blocked by a host function");
  char c;
  while (read(g_release_fd, &c, 1) < 0 && errno == EINTR) {
  }
}

}  // namespace

extern "C" {

int blocker_upload(float** device, const float* host, int n) {
  cudaError_t e = cudaMalloc(reinterpret_cast<void**>(device), sizeof(float) * n);
  if (e == cudaSuccess) e = cudaMemcpy(*device, host, sizeof(float) * n, cudaMemcpyHostToDevice);
  return e;
}

int block_and_sync(int release_fd) {
  g_release_fd = release_fd;
  cudaStream_t s = nullptr;
  cudaError_t e = cudaStreamCreate(&s);  // blocking stream: the legacy default stream waits for it
  if (e == cudaSuccess) e = cudaLaunchHostFunc(s, report_and_block, nullptr);
  if (e == cudaSuccess) e = cudaStreamSynchronize(s);
  return e;
}

// Sets a sticky device fault (simcuda's private simcudaSetStickyError, as its NCCL failure injection
// does) and returns what `call` then returns: 0 cudaGetLastError, 1 cudaPeekAtLastError,
// 2 cudaMemsetAsync, 3 cudaEventRecord. -1 without simcuda.
int sticky_fault_then(int call, void* device) {
  auto set_sticky = reinterpret_cast<void (*)(cudaError_t)>(dlsym(RTLD_DEFAULT, "simcudaSetStickyError"));
  if (set_sticky == nullptr) return -1;
  cudaEvent_t event = nullptr;
  if (call == 3 && cudaEventCreateWithFlags(&event, cudaEventDisableTiming) != cudaSuccess) return -2;
  set_sticky(cudaErrorIllegalAddress);
  switch (call) {
    case 0: return cudaGetLastError();
    case 1: return cudaPeekAtLastError();
    case 2: return cudaMemsetAsync(device, 0, 4, nullptr);
    case 3: return cudaEventRecord(event, nullptr);
    default: return -3;
  }
}

int copy_to_host(float* host, const float* device, int n) {
  return cudaMemcpy(host, device, sizeof(float) * n, cudaMemcpyDeviceToHost);
}

}  // extern "C"
