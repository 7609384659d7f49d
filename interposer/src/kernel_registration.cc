// nvcc's registration and launch-configuration ABI (__cudaRegisterFatBinary, __cudaRegisterFunction,
// __cudaPushCallConfiguration, __cudaGetKernel, ...): not declared in the public headers, called by
// the host code nvcc generates. Observe mode passes each to the real runtime. Proxy mode keeps
// them in the client: registrations go into the kernel table (each fat binary and its kernels are
// sent to the proxy before the first use of one of them, and can be sent to a new proxy), and the launch
// configuration is a per-thread stack, as in libcudart.
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "diagnostics.h"
#include "next_symbol.h"
#include "proxy_calls.h"
#include "proxy_forwarding.h"
#include "real_api.h"

namespace jitckpt::proxy_mode {
namespace {

struct LaunchConfig {
  dim3 grid, block;
  size_t shared_mem;
  cudaStream_t stream;
};

std::vector<LaunchConfig>& config_stack() {
  thread_local std::vector<LaunchConfig> stack;
  return stack;
}

bool proxy() { return session().enabled(); }

cudaError_t launch_by_handle(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shmem,
                             cudaStream_t stream) {
  return proxy_call::cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid, block, args, shmem, stream);
}
cudaError_t launch_by_handle_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shmem,
                                  cudaStream_t stream) {
  return launch_by_handle(kernel, grid, block, args, shmem, per_thread_stream(stream));
}

}  // namespace

void* extra_forwarder(const char* name) {
  if (std::strcmp(name, "__cudaLaunchKernel") == 0) return reinterpret_cast<void*>(&launch_by_handle);
  if (std::strcmp(name, "__cudaLaunchKernel_ptsz") == 0) return reinterpret_cast<void*>(&launch_by_handle_ptsz);
  return nullptr;
}

}  // namespace jitckpt::proxy_mode

using jitckpt::NextSymbol;
using jitckpt::kCudartSoname;
using jitckpt::proxy_mode::config_stack;
using jitckpt::proxy_mode::proxy;
using jitckpt::proxy_mode::session;

#pragma GCC visibility push(default)
extern "C" {

void** __cudaRegisterFatBinary(void* fatCubin) {
  static NextSymbol<void** (*)(void*)> next{"__cudaRegisterFatBinary", kCudartSoname};
  if (!proxy()) return next.get()(fatCubin);
  return session().kernels().add_module(fatCubin);
}

void __cudaRegisterFatBinaryEnd(void** handle) {
  static NextSymbol<void (*)(void**)> next{"__cudaRegisterFatBinaryEnd", kCudartSoname};
  if (!proxy()) next.get()(handle);
}

void __cudaUnregisterFatBinary(void** handle) {
  static NextSymbol<void (*)(void**)> next{"__cudaUnregisterFatBinary", kCudartSoname};
  if (!proxy()) next.get()(handle);  // proxy mode: the proxy goes with the process
}

char __cudaInitModule(void** handle) {
  static NextSymbol<char (*)(void**)> next{"__cudaInitModule", kCudartSoname};
  return proxy() ? 1 : next.get()(handle);
}

void __cudaRegisterFunction(void** handle, const char* hostFun, char* deviceFun, const char* deviceName,
                            int threadLimit, uint3* tid, uint3* bid, dim3* bDim, dim3* gDim, int* wSize) {
  static NextSymbol<void (*)(void**, const char*, char*, const char*, int, uint3*, uint3*, dim3*, dim3*, int*)> next{
      "__cudaRegisterFunction", kCudartSoname};
  if (!proxy()) return next.get()(handle, hostFun, deviceFun, deviceName, threadLimit, tid, bid, bDim, gDim, wSize);
  session().kernels().add(handle, hostFun, deviceFun);
}

void __cudaRegisterVar(void** handle, char* hostVar, char* deviceAddress, const char* deviceName, int ext,
                       size_t size, int constant, int global) {
  static NextSymbol<void (*)(void**, char*, char*, const char*, int, size_t, int, int)> next{"__cudaRegisterVar",
                                                                                            kCudartSoname};
  if (!proxy()) return next.get()(handle, hostVar, deviceAddress, deviceName, ext, size, constant, global);
  jitckpt::log_always("proxy mode: __device__ variable %s is not supported yet; kernels using it will fail",
                      deviceName ? deviceName : "?");
}

void __cudaRegisterManagedVar(void** handle, void** hostVarPtrAddress, char* deviceAddress, const char* deviceName,
                              int ext, size_t size, int constant, int global) {
  static NextSymbol<void (*)(void**, void**, char*, const char*, int, size_t, int, int)> next{
      "__cudaRegisterManagedVar", kCudartSoname};
  if (!proxy()) return next.get()(handle, hostVarPtrAddress, deviceAddress, deviceName, ext, size, constant, global);
  jitckpt::log_always("proxy mode: __managed__ variable %s is not supported (unified memory)",
                      deviceName ? deviceName : "?");
}

unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t shmem, struct CUstream_st* stream) {
  static NextSymbol<unsigned (*)(dim3, dim3, size_t, struct CUstream_st*)> next{"__cudaPushCallConfiguration",
                                                                                kCudartSoname};
  if (!proxy()) return next.get()(grid, block, shmem, stream);
  config_stack().push_back({grid, block, shmem, stream});
  return 0;
}

cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* shmem, void* stream) {
  static NextSymbol<cudaError_t (*)(dim3*, dim3*, size_t*, void*)> next{"__cudaPopCallConfiguration",
                                                                        kCudartSoname};
  if (!proxy()) return next.get()(grid, block, shmem, stream);
  auto& stack = config_stack();
  if (stack.empty()) return cudaErrorMissingConfiguration;
  const auto c = stack.back();
  stack.pop_back();
  *grid = c.grid;
  *block = c.block;
  *shmem = c.shared_mem;
  *static_cast<cudaStream_t*>(stream) = c.stream;
  return cudaSuccess;
}

cudaError_t __cudaGetKernel(cudaKernel_t* out, const void* hostFun) {
  static NextSymbol<cudaError_t (*)(cudaKernel_t*, const void*)> next{"__cudaGetKernel", kCudartSoname};
  if (!proxy()) return next.get()(out, hostFun);
  jitckpt::ClientKernel* k = session().kernels().find(hostFun);
  if (out == nullptr || k == nullptr) return cudaErrorInvalidDeviceFunction;
  *out = reinterpret_cast<cudaKernel_t>(k);
  return cudaSuccess;
}

}  // extern "C"
#pragma GCC visibility pop
