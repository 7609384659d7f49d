// Proxy mode's hand-written calls (the SPECIAL and CLIENT entries of
// jitckpt/proxy_api/dispositions.py; signatures in the generated proxy_calls.h): memory, copies,
// pinned host memory, kernel launches, and what the client answers itself.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "proxy_calls.h"
#include "proxy_forwarding.h"
#include "real_api.h"
#include "shared_memfd.h"

namespace jitckpt::proxy_mode {
namespace {

using Memory = ProxySession::Memory;
using proxy::Call;

thread_local cudaError_t t_last_cuda_error = cudaSuccess;
thread_local char t_last_nccl_error[256] = "";

// Pageable bytes travel in the ring in chunks this size (a message holds at most half the ring).
constexpr size_t kChunk = size_t{1} << 20;

uint64_t u64(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// The real library's own definition, for the pure functions the client answers (string tables,
// versions): they touch no device state.
template <typename Fn>
Fn real(const char* name, const char* soname) {
  return reinterpret_cast<Fn>(resolve_real_symbol(name, soname));
}

// Sends module `m` (its fat binary and kernel names, in a memfd) to the proxy, once.
cudaError_t send_module(ClientModule* m) {
  if (m->proxy_id >= 0) return cudaSuccess;
  std::string names;
  for (const std::string& n : m->kernel_names) names.append(n).push_back('\0');
  const size_t total = m->image_size + names.size();
  const int fd = shared_memfd("jitckpt-module", total, {{m->image, m->image_size}, {names.data(), names.size()}});
  if (fd < 0) {
    log_always("proxy mode: cannot stage a module of %zu bytes for the proxy: %s", total, std::strerror(errno));
    record_cuda_error(cudaErrorMemoryAllocation);
    return cudaErrorMemoryAllocation;
  }
  const uint64_t token = session().next_token();
  CallWriter w(static_cast<uint32_t>(Call::kRegisterModule), false);
  w.value(proxy::RegisterModule{token, m->image_size, names.size(), static_cast<uint32_t>(m->kernel_names.size()), 0});
  Reply r = w.send("module registration", fd, token);
  close(fd);
  uint32_t id = 0;
  r.result(&id);
  if (cudaError_t e = r.status<cudaError_t>(); e != cudaSuccess) return e;
  m->proxy_id = id;
  log_verbose("proxy mode: module %u sent to the proxy: a fat binary of %zu bytes, %zu kernels", id, m->image_size,
              m->kernel_names.size());
  return cudaSuccess;
}

// The kernel `func` names (host stub or cudaKernel_t), registered with the proxy on first use.
cudaError_t registered(const void* func, ClientKernel** out) {
  ClientKernel* k = session().kernels().find(func);
  if (k == nullptr) {
    log_always("proxy mode: %p is not a kernel registered by this process", func);
    record_cuda_error(cudaErrorInvalidDeviceFunction);
    return cudaErrorInvalidDeviceFunction;
  }
  if (k->proxy_id < 0) {
    std::lock_guard<std::mutex> lock(session().kernels().registration_mutex());
    if (k->proxy_id < 0) {
      if (cudaError_t e = send_module(k->module); e != cudaSuccess) return e;
      CallWriter w(static_cast<uint32_t>(Call::kRegisterKernel), false);
      w.value(proxy::KernelRef{static_cast<uint32_t>(k->module->proxy_id), k->index});
      Reply r = w.send("kernel registration");
      const proxy::CallResult& raw = r.raw();
      if (raw.status != 0) return r.status<cudaError_t>();
      proxy::KernelInfo info{};
      if (raw.results.size() < sizeof info) return cudaErrorUnknown;
      std::memcpy(&info, raw.results.data(), sizeof info);
      if (raw.results.size() != sizeof info + info.num_params * sizeof(proxy::KernelParam)) return cudaErrorUnknown;
      k->params.resize(info.num_params);
      if (info.num_params)
        std::memcpy(k->params.data(), raw.results.data() + sizeof info, info.num_params * sizeof(proxy::KernelParam));
      for (const auto& p : k->params) k->param_bytes = std::max(k->param_bytes, p.offset + p.size);
      k->proxy_id = info.kernel_id;
    }
  }
  *out = k;
  return cudaSuccess;
}

// One kernel-attribute request (see proxy::KernelAttribute); `result`, if given, receives the reply.
template <typename T>
cudaError_t kernel_attribute(const void* func, proxy::KernelAttribute a, T* result) {
  ClientKernel* k = nullptr;
  if (cudaError_t e = registered(func, &k); e != cudaSuccess) return e;
  a.kernel_id = static_cast<uint32_t>(k->proxy_id);
  CallWriter w(static_cast<uint32_t>(Call::kKernelAttribute), false);
  w.value(a);
  Reply r = w.send("kernel attribute");
  r.result(result);
  return r.status<cudaError_t>();
}

cudaError_t launch(const void* func, dim3 grid, dim3 block, void** args, size_t shmem, cudaStream_t stream) {
  ClientKernel* k = nullptr;
  if (cudaError_t e = registered(func, &k); e != cudaSuccess) return e;
  proxy::LaunchKernel head{};
  head.kernel_id = static_cast<uint32_t>(k->proxy_id);
  head.grid[0] = grid.x, head.grid[1] = grid.y, head.grid[2] = grid.z;
  head.block[0] = block.x, head.block[1] = block.y, head.block[2] = block.z;
  head.param_bytes = k->param_bytes;
  head.shared_mem = shmem;
  head.stream = u64(stream);
  CallWriter w(static_cast<uint32_t>(Call::kLaunchKernel), true);
  w.value(head);
  uint8_t params[4096];
  if (k->param_bytes > sizeof params) return refuse<cudaError_t>("cudaLaunchKernel", "more than 4 KiB of kernel parameters");
  std::memset(params, 0, k->param_bytes);
  for (size_t i = 0; i < k->params.size(); ++i) std::memcpy(params + k->params[i].offset, args[i], k->params[i].size);
  w.bytes(params, k->param_bytes);
  const cudaError_t e = w.send("cudaLaunchKernel").status<cudaError_t>();
  // The undo plugin tells later which of the optimizer step's launches ran (update_undo.h).
  if (e == cudaSuccess && session().undo().in_optimizer_step())
    session().undo().launched(session().last_journal_id(), static_cast<uint32_t>(k->proxy_id), k->name, stream);
  return e;
}

bool same_parameters(const ClientKernel& a, const ClientKernel& b) {
  if (a.params.size() != b.params.size()) return false;
  for (size_t i = 0; i < a.params.size(); ++i)
    if (a.params[i].offset != b.params[i].offset || a.params[i].size != b.params[i].size) return false;
  return true;
}

cudaError_t host_alloc(void** ptr, size_t size, unsigned int flags) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  *ptr = nullptr;
  if (size == 0) return cudaSuccess;
  const size_t pages = (size + 4095) / 4096 * 4096;
  const int fd = shared_memfd("jitckpt-pinned", pages);
  if (fd < 0) {
    record_cuda_error(cudaErrorMemoryAllocation);
    return cudaErrorMemoryAllocation;
  }
  // The buffer must sit at the same address in both processes. The hint makes that the rule; if
  // the address is taken in the proxy anyway, keep it reserved here and try another.
  std::vector<void*> taken;
  void* p = MAP_FAILED;
  cudaError_t e = cudaErrorMemoryAllocation;
  for (int attempt = 0; attempt < 8; ++attempt) {
    p = mmap(session().pinned_hint(pages), pages, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) break;
    const uint64_t token = session().next_token();
    CallWriter w(static_cast<uint32_t>(Call::kHostAlloc), false);
    w.value(proxy::HostAlloc{u64(p), pages, token, flags, 0});
    Reply r = w.send("cudaHostAlloc", fd, token);
    if (r.raw().status == cudaErrorMemoryAllocation && r.raw().error.find("File exists") != std::string::npos) {
      taken.push_back(p);
      p = MAP_FAILED;
      continue;
    }
    e = r.status<cudaError_t>();
    break;
  }
  close(fd);
  for (void* t : taken) munmap(t, pages);
  if (e != cudaSuccess) {
    if (p != MAP_FAILED) munmap(p, pages);
    record_cuda_error(e);
    return e;
  }
  session().add_memory(reinterpret_cast<uintptr_t>(p), pages, Memory::kPinned);
  *ptr = p;
  return cudaSuccess;
}

// A copy from pinned or registered memory to the device: the application may rewrite the source
// once the copy is done, so the replay journal keeps the bytes it reads (ProxySession::SourceCopy).
bool shared_host_to_device(Memory d, Memory s) {
  return d == Memory::kDevice && (s == Memory::kPinned || s == Memory::kRegistered);
}

// Copies whose pageable side travels in the ring; with a stream they are stream-ordered. To the
// device, the bytes are staged at the call (as CUDA does), so the async form needs no reply.
cudaError_t copy_to_device(void* dst, const void* src, size_t count, cudaStream_t* stream) {
  for (size_t off = 0; off < count; off += kChunk) {
    const size_t n = std::min(kChunk, count - off);
    CallWriter w(static_cast<uint32_t>(stream ? Call::kMemcpyToDeviceAsync : Call::kMemcpyToDevice), stream != nullptr);
    if (stream)
      w.value(proxy::MemcpyInline{u64(dst) + off, n, u64(*stream)});
    else
      w.value(proxy::MemcpyToDevice{u64(dst) + off, n});
    w.bytes(static_cast<const uint8_t*>(src) + off, n);
    if (cudaError_t e = w.send(stream ? "cudaMemcpyAsync" : "cudaMemcpy").status<cudaError_t>(); e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

cudaError_t copy_from_device(void* dst, const void* src, size_t count, cudaStream_t* stream) {
  for (size_t off = 0; off < count; off += kChunk) {
    const size_t n = std::min(kChunk, count - off);
    CallWriter w(static_cast<uint32_t>(stream ? Call::kMemcpyFromDeviceAsync : Call::kMemcpyFromDevice), false);
    if (stream)
      w.value(proxy::MemcpyInline{u64(src) + off, n, u64(*stream)});
    else
      w.value(proxy::MemcpyFromDevice{u64(src) + off, n});
    Reply r = w.send(stream ? "cudaMemcpyAsync" : "cudaMemcpy");
    if (cudaError_t e = r.status<cudaError_t>(); e != cudaSuccess) return e;
    if (r.raw().results.size() != n) return cudaErrorUnknown;
    std::memcpy(static_cast<uint8_t*>(dst) + off, r.raw().results.data(), n);
  }
  return cudaSuccess;
}

}  // namespace

void record_cuda_error(cudaError_t e) {
  // "Not ready" from a query is an answer, not an error: the runtime does not record it either.
  if (e != cudaSuccess && e != cudaErrorNotReady) t_last_cuda_error = e;
}
void record_nccl_error(const char* text) { std::snprintf(t_last_nccl_error, sizeof t_last_nccl_error, "%s", text); }

int register_inverse(const void* kernel, const void* inverse) {
  ClientKernel* k = nullptr;
  ClientKernel* inv = nullptr;
  if (registered(kernel, &k) != cudaSuccess) return 1;  // said on stderr
  if (inverse != nullptr && registered(inverse, &inv) != cudaSuccess) return 1;
  if (inv != nullptr && !same_parameters(*k, *inv)) {
    log_always("jitckpt_register_inverse: %s takes other parameters than %s; an inverse is launched with the "
               "arguments of the kernel it undoes, so it must take the same ones", inv->name.c_str(), k->name.c_str());
    return 1;
  }
  session().undo().add(static_cast<uint32_t>(k->proxy_id), inv != nullptr ? inv->proxy_id : -1);
  return 0;
}

namespace proxy_call {

cudaError_t cudaMalloc(void** devPtr, size_t size) {
  if (devPtr == nullptr) return cudaErrorInvalidValue;
  CallWriter w(static_cast<uint32_t>(Call::kMalloc), false);
  w.value(proxy::SizeArg{size});
  Reply r = w.send("cudaMalloc");
  uint64_t p = 0;
  r.result(&p);
  cudaError_t e = r.status<cudaError_t>();
  *devPtr = e == cudaSuccess ? reinterpret_cast<void*>(p) : nullptr;
  if (e == cudaSuccess && p) session().add_memory(p, size, Memory::kDevice);
  return e;
}

cudaError_t cudaFree(void* devPtr) {
  CallWriter w(static_cast<uint32_t>(Call::kFree), false);
  w.value(proxy::PointerArg{u64(devPtr)});
  cudaError_t e = w.send("cudaFree").status<cudaError_t>();
  if (e == cudaSuccess && devPtr) session().remove_memory(reinterpret_cast<uintptr_t>(devPtr), Memory::kDevice);
  return e;
}

cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* attributes, const void* ptr) {
  if (attributes == nullptr) return cudaErrorInvalidValue;
  *attributes = cudaPointerAttributes{};
  switch (session().memory_of(ptr)) {
    case Memory::kDevice:
      attributes->type = cudaMemoryTypeDevice;
      attributes->devicePointer = const_cast<void*>(ptr);
      break;
    case Memory::kPinned:
    case Memory::kRegistered:
      attributes->type = cudaMemoryTypeHost;
      attributes->devicePointer = attributes->hostPointer = const_cast<void*>(ptr);
      break;
    case Memory::kPageable:
      attributes->type = cudaMemoryTypeUnregistered;
      attributes->device = -2;  // what CUDA reports for memory it does not know
      return cudaSuccess;
  }
  auto get_device = reinterpret_cast<cudaError_t (*)(int*)>(forwarder("cudaGetDevice"));
  return get_device(&attributes->device);
}

cudaError_t cudaMallocHost(void** ptr, size_t size) { return host_alloc(ptr, size, cudaHostAllocDefault); }
cudaError_t cudaHostAlloc(void** pHost, size_t size, unsigned int flags) { return host_alloc(pHost, size, flags); }

cudaError_t cudaHostRegister(void* ptr, size_t size, unsigned int flags) {
  return session().registrations().add(ptr, size, flags);
}
cudaError_t cudaHostUnregister(void* ptr) { return session().registrations().remove(ptr); }

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  size_t size = 0;
  if (session().memory_of(ptr) != Memory::kPinned) {
    log_always("proxy mode: cudaFreeHost(%p): not pinned memory from cudaHostAlloc/cudaMallocHost", ptr);
    record_cuda_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  CallWriter w(static_cast<uint32_t>(Call::kHostFree), false);
  w.value(proxy::PointerArg{u64(ptr)});
  cudaError_t e = w.send("cudaFreeHost").status<cudaError_t>();
  if (session().remove_memory(reinterpret_cast<uintptr_t>(ptr), Memory::kPinned, &size)) munmap(ptr, size);
  return e;
}

cudaError_t cudaHostGetDevicePointer(void** pDevice, void* pHost, unsigned int flags) {
  const Memory m = session().memory_of(pHost);
  if (pDevice == nullptr || flags != 0 || (m != Memory::kPinned && m != Memory::kRegistered)) {
    record_cuda_error(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  *pDevice = pHost;  // unified addressing: the same address on both sides
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  if (count == 0) return cudaSuccess;
  const Memory d = session().memory_of(dst, count), s = session().memory_of(src, count);
  if (d != Memory::kPageable && s == Memory::kPageable && kind != cudaMemcpyDeviceToDevice)
    return copy_to_device(dst, src, count, nullptr);
  if (s != Memory::kPageable && d == Memory::kPageable && kind != cudaMemcpyDeviceToDevice)
    return copy_from_device(dst, src, count, nullptr);
  if (d == Memory::kPageable && s == Memory::kPageable && (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault)) {
    std::memcpy(dst, src, count);
    return cudaSuccess;
  }
  // Both sides in memory the proxy knows, or a pointer it does not: the proxy checks and says which.
  CallWriter w(static_cast<uint32_t>(Call::kMemcpy), false);
  w.value(proxy::MemcpyAddresses{u64(dst), u64(src), count, static_cast<int32_t>(kind), 0, 0});
  const ProxySession::SourceCopy source{{u64(dst), 0, false}, src, count};
  return w.send("cudaMemcpy", -1, 0, shared_host_to_device(d, s) ? &source : nullptr).status<cudaError_t>();
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const Memory d = session().memory_of(dst, count), s = session().memory_of(src, count);
  if (d != Memory::kPageable && s == Memory::kPageable && kind != cudaMemcpyDeviceToDevice)
    return copy_to_device(dst, src, count, &stream);
  if (s != Memory::kPageable && d == Memory::kPageable && kind != cudaMemcpyDeviceToDevice)
    return copy_from_device(dst, src, count, &stream);  // returns once the copy is done, as CUDA does
  CallWriter w(static_cast<uint32_t>(Call::kMemcpyAsync), true);
  w.value(proxy::MemcpyAddresses{u64(dst), u64(src), count, static_cast<int32_t>(kind), 0, u64(stream)});
  const ProxySession::SourceCopy source{{u64(dst), u64(stream), true}, src, count};
  return w.send("cudaMemcpyAsync", -1, 0, shared_host_to_device(d, s) ? &source : nullptr).status<cudaError_t>();
}

cudaError_t cudaMemset(void* devPtr, int value, size_t count) {
  CallWriter w(static_cast<uint32_t>(Call::kMemset), false);
  w.value(proxy::Memset{u64(devPtr), count, value, 0});
  return w.send("cudaMemset").status<cudaError_t>();
}

cudaError_t cudaLaunchKernel(const void* func, dim3 gridDim, dim3 blockDim, void** args, size_t sharedMem,
                             cudaStream_t stream) {
  return launch(func, gridDim, blockDim, args, sharedMem, stream);
}

cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* config, const void* func, void** args) {
  if (config == nullptr) return cudaErrorInvalidValue;
  if (config->numAttrs != 0)
    return refuse<cudaError_t>("cudaLaunchKernelExC", "launch attributes are not forwarded yet");
  return launch(func, config->gridDim, config->blockDim, args, config->dynamicSmemBytes, config->stream);
}

cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes* attr, const void* func) {
  if (attr == nullptr) return cudaErrorInvalidValue;
  return kernel_attribute(func, proxy::KernelAttribute{0, proxy::KernelAttribute::kGet, 0, 0, 0, 0, 0}, attr);
}

cudaError_t cudaFuncSetAttribute(const void* func, enum cudaFuncAttribute attr, int value) {
  return kernel_attribute<int>(func, {0, proxy::KernelAttribute::kSet, attr, value, 0, 0, 0}, nullptr);
}

cudaError_t cudaKernelSetAttributeForDevice(cudaKernel_t kernel, enum cudaFuncAttribute attr, int value, int device) {
  return kernel_attribute<int>(kernel, {0, proxy::KernelAttribute::kSetForDevice, attr, value, device, 0, 0}, nullptr);
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* numBlocks, const void* func, int blockSize,
                                                                   size_t dynamicSMemSize, unsigned int flags) {
  if (numBlocks == nullptr) return cudaErrorInvalidValue;
  int32_t n = 0;
  cudaError_t e = kernel_attribute(func, {0, proxy::KernelAttribute::kOccupancy, blockSize, static_cast<int32_t>(flags),
                                          0, 0, dynamicSMemSize}, &n);
  *numBlocks = n;
  return e;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, const void* func, int blockSize,
                                                          size_t dynamicSMemSize) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(numBlocks, func, blockSize, dynamicSMemSize, 0);
}

cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last_cuda_error;
  t_last_cuda_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError(void) { return t_last_cuda_error; }

cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* pCaptureStatus) {
  if (pCaptureStatus == nullptr) return cudaErrorInvalidValue;
  *pCaptureStatus = cudaStreamCaptureStatusNone;  // capture is refused in proxy mode
  return cudaSuccess;
}
const char* ncclGetLastError(ncclComm_t) { return t_last_nccl_error; }

const char* cudaGetErrorName(cudaError_t error) {
  auto fn = real<decltype(&::cudaGetErrorName)>("cudaGetErrorName", kCudartSoname);
  return fn ? fn(error) : "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t error) {
  auto fn = real<decltype(&::cudaGetErrorString)>("cudaGetErrorString", kCudartSoname);
  return fn ? fn(error) : "unknown error";
}
const char* ncclGetErrorString(ncclResult_t result) {
  auto fn = real<decltype(&::ncclGetErrorString)>("ncclGetErrorString", kNcclSoname);
  return fn ? fn(result) : "unknown NCCL error";
}
cudaError_t cudaRuntimeGetVersion(int* runtimeVersion) {
  auto fn = real<decltype(&::cudaRuntimeGetVersion)>("cudaRuntimeGetVersion", kCudartSoname);
  return fn ? fn(runtimeVersion) : cudaErrorNotSupported;
}
ncclResult_t ncclGetVersion(int* version) {
  auto fn = real<decltype(&::ncclGetVersion)>("ncclGetVersion", kNcclSoname);
  return fn ? fn(version) : ncclInvalidUsage;
}
struct cudaChannelFormatDesc cudaCreateChannelDesc(int x, int y, int z, int w, enum cudaChannelFormatKind f) {
  return cudaChannelFormatDesc{x, y, z, w, f};
}
void ncclParamDumpAll(void) {
  if (auto fn = real<decltype(&::ncclParamDumpAll)>("ncclParamDumpAll", kNcclSoname)) fn();
}

}  // namespace proxy_call
}  // namespace jitckpt::proxy_mode
