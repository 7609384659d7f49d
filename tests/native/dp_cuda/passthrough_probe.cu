// Calls CUDA runtime entry points (interposed by libjit.so and not) and prints "<call> <error name>"
// per line, so a run with LD_PRELOAD=libjit.so can be compared line by line with a run without it.
#include <cuda_runtime.h>

#include <cstdio>

__global__ void touch(float* x) { x[threadIdx.x] += 1.0f; }

#define SHOW(call) std::printf("%s %s\n", #call, cudaGetErrorName(call))

int main() {
  int count = -1;
  SHOW(cudaGetDeviceCount(&count));
  std::printf("device_count %d\n", count);
  float* d = nullptr;
  SHOW(cudaMalloc(&d, 64));
  cudaStream_t s = nullptr;
  SHOW(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e = nullptr;
  SHOW(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  SHOW(cudaEventRecord(e, s));
  SHOW(cudaEventRecordWithFlags(e, s, 0));
  SHOW(cudaStreamWaitEvent(nullptr, e, 0));
  float h[16] = {0};
  SHOW(cudaMemcpyAsync(h, d, sizeof h, cudaMemcpyDeviceToHost, s));
  SHOW(cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost));
  SHOW(cudaMemsetAsync(d, 0, 64, s));
  touch<<<1, 16, 0, s>>>(d);
  SHOW(cudaGetLastError());
  void* args[] = {&d};
  SHOW(cudaLaunchKernel(reinterpret_cast<const void*>(&touch), dim3(1), dim3(16), args, 0, s));
  SHOW(cudaStreamSynchronize(s));
  SHOW(cudaEventSynchronize(e));
  SHOW(cudaDeviceSynchronize());
  SHOW(cudaEventQuery(e));
  SHOW(cudaFree(d));
  return 0;
}
