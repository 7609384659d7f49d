#include "call_dispatcher.h"

#include "call_kinds.h"

#include <shared_mutex>

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

// cudaKernel_t of a registered kernel (nvcc's ABI, crt/host_runtime.h).
extern "C" cudaError_t __cudaGetKernel(cudaKernel_t* kernel, const void* hostFun);

namespace jitckpt::proxy {

namespace {

constexpr int kFdWaitMs = 5000;

std::string hex(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

void fail(GenericReply* out, cudaError_t e, std::string why) {
  out->status = e;
  out->error = std::move(why);
}

// Copies the fixed arguments out of the ring (the writer is another process) and checks their size;
// `extra` allows trailing bytes (a copy's payload, a launch's parameters).
template <typename T>
bool take(const char* name, const uint8_t* args, size_t nargs, T* v, GenericReply* out, bool extra = false) {
  if (nargs < sizeof *v || (!extra && nargs != sizeof *v)) {
    fail(out, cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(nargs) +
                                         " argument bytes, expected " + std::to_string(sizeof *v));
    return false;
  }
  std::memcpy(v, args, sizeof *v);
  return true;
}

}  // namespace

bool CallDispatcher::handle(uint32_t call, const uint8_t* data, size_t len, std::vector<uint8_t>* reply) {
  RequestHead req{};
  if (len >= sizeof req.seq) std::memcpy(&req.seq, data, sizeof req.seq);  // a short request gets its seq back
  if (len >= sizeof req) std::memcpy(&req, data, sizeof req);
  const bool no_reply = len >= sizeof req && (req.flags & kNoReply) != 0;
  GenericReply out;
  const char* name = call_name(call);
  if (name == nullptr)
    fail(&out, cudaErrorNotSupported, "unknown call " + std::to_string(call));
  else if (len < sizeof req)
    fail(&out, cudaErrorInvalidValue, std::string(name) + ": truncated request");
  else if (state_.fenced.load() && !runs_when_fenced(call))
    out.status = std::strncmp(name, "nccl", 4) == 0 ? static_cast<int32_t>(ncclInvalidUsage)
                                                     : static_cast<int32_t>(cudaErrorNotPermitted);
  else
    run(call, name, data + sizeof req, len - sizeof req, &out);
  if (!out.error.empty()) std::fprintf(stderr, "jitckpt-proxy: %s\n", out.error.c_str());
  if (state_.fence_on_nccl_failure && !state_.fenced.load()) fence_if_nccl_failed(call, name, req.seq, out);
  if (state_.fenced.load() && async_status_ == 0) {  // every reply tells of the failure
    async_status_ = state_.fence_status.load();
    async_call_ = state_.fence_call.load();
    async_seq_ = state_.fence_seq.load();
  }
  if (no_reply) {
    if (out.status != 0 && async_status_ == 0) {
      async_status_ = out.status;
      async_call_ = call;
      async_seq_ = req.seq;
    }
    return false;
  }
  ReplyHead head{};
  head.seq = req.seq;
  head.status = out.status;
  head.has_text = out.error.empty() ? 0 : 1;
  std::snprintf(head.text, sizeof head.text, "%s", out.error.c_str());
  head.async_status = async_status_;
  head.async_call = async_call_;
  head.async_seq = async_seq_;
  async_status_ = 0;
  reply->resize(sizeof head + out.results.size());
  std::memcpy(reply->data(), &head, sizeof head);
  if (!out.results.empty()) std::memcpy(reply->data() + sizeof head, out.results.data(), out.results.size());
  return true;
}

bool CallDispatcher::runs_when_fenced(uint32_t call) {
  switch (static_cast<Call>(call)) {
    case Call::kSaveDevice:
    case Call::kMemcpyFromDevice:
    case Call::kMemcpyFromDeviceAsync:
    case Call::kCloseChannel:
      return true;
    default:
      break;
  }
  return call >= kGenericBase && (function_kinds(call - kGenericBase) & kCallStateless) != 0;
}

void CallDispatcher::fence_if_nccl_failed(uint32_t call, const char* name, uint64_t seq, const Outcome& out) {
  if (!communication_failed(name, out.status)) return;
  state_.fence_status = out.status;
  state_.fence_call = call;
  state_.fence_seq = seq;
  state_.fenced = true;
  std::fprintf(stderr, "jitckpt-proxy: %s failed; no more device work runs here (fenced for recovery)\n", name);
}

void CallDispatcher::run(uint32_t call, const char* name, const uint8_t* args, size_t nargs, Outcome* out) {
  if (call >= kGenericBase) {
    ArgReader reader(name, std::strncmp(name, "nccl", 4) == 0, args, nargs, out);
    std::shared_lock<std::shared_mutex> query(state_.comm_lifetime, std::defer_lock);
    std::unique_lock<std::shared_mutex> end(state_.comm_lifetime, std::defer_lock);
    if (std::strncmp(name, "ncclComm", 8) == 0 && std::strncmp(name, "ncclCommInit", 12) != 0 &&
        std::strncmp(name, "ncclCommSplit", 13) != 0) {  // not the ones that wait for peers
      const bool ends = std::strstr(name, "Destroy") || std::strstr(name, "Abort") || std::strstr(name, "Finalize");
      if (ends) end.lock();
      else query.lock();
    }
    run_generic(call - kGenericBase, reader, *out, state_.handles, state_.memory);
    return;
  }
  run_special(static_cast<Call>(call), name, args, nargs, out);
}

void CallDispatcher::run_special(Call call, const char* name, const uint8_t* args, size_t nargs, Outcome* out) {
  using Kind = AddressBook::Kind;
  auto outside = [&](uint64_t p, uint64_t n) {
    fail(out, cudaErrorInvalidValue, std::string(name) + ": [" + hex(p) + ", +" + std::to_string(n) +
                                         ") is outside the device arena and the pinned memory of this proxy");
  };
  // A copy whose bytes travel in the request: exactly `count` of them must follow its arguments.
  auto payload_is = [&](uint64_t count, size_t head) {
    if (count == nargs - head) return true;
    fail(out, cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(nargs - head) +
                                         " payload bytes for a copy of " + std::to_string(count));
    return false;
  };
  auto stream_of = [&](uint64_t virt, cudaStream_t* s) {
    if (state_.handles.resolve(virt, s)) return true;
    fail(out, cudaErrorInvalidResourceHandle, std::string(name) + ": unknown stream handle " + hex(virt));
    return false;
  };
  switch (call) {
    case Call::kMalloc: {
      SizeArg a;
      if (!take(name, args, nargs, &a, out)) return;
      void* p = nullptr;
      std::string why;
      out->status = state_.arena.allocate(a.size, &p, &why);
      if (out->status != cudaSuccess && !why.empty() && !state_.arena.usable()) {
        out->status = cudaMalloc(&p, a.size);  // no fixed arena here: the job runs, its replays cannot
      } else if (out->status != cudaSuccess && !why.empty()) {
        return fail(out, static_cast<cudaError_t>(out->status), "cudaMalloc: " + why);
      }
      if (out->status == cudaSuccess && p != nullptr)
        state_.memory.add(reinterpret_cast<uint64_t>(p), a.size, Kind::kDevice);
      return out->result(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)));
    }
    case Call::kFree: {
      PointerArg a;
      if (!take(name, args, nargs, &a, out)) return;
      if (a.ptr == 0) {
        out->status = cudaFree(nullptr);
        return;
      }
      if (state_.memory.size_of(a.ptr) == 0 || state_.memory.kind_of(a.ptr, 1) != Kind::kDevice)
        return fail(out, cudaErrorInvalidValue, "cudaFree: " + hex(a.ptr) + " is not a device allocation of this proxy");
      std::string why;
      out->status = state_.arena.owns(reinterpret_cast<void*>(a.ptr))
                        ? state_.arena.release(reinterpret_cast<void*>(a.ptr), &why)
                        : cudaFree(reinterpret_cast<void*>(a.ptr));
      if (!why.empty()) return fail(out, static_cast<cudaError_t>(out->status), "cudaFree: " + why);
      if (out->status == cudaSuccess) state_.memory.remove(a.ptr, Kind::kDevice);
      return;
    }
    case Call::kMemcpyToDevice: {
      MemcpyToDevice a;
      if (!take(name, args, nargs, &a, out, true)) return;
      if (!payload_is(a.count, sizeof a)) return;
      if (state_.memory.kind_of(a.dst, a.count) == Kind::kNone) return outside(a.dst, a.count);
      out->status = cudaMemcpy(reinterpret_cast<void*>(a.dst), args + sizeof a, a.count, cudaMemcpyDefault);
      return;
    }
    case Call::kMemcpyFromDevice: {
      MemcpyFromDevice a;
      if (!take(name, args, nargs, &a, out)) return;
      if (state_.memory.kind_of(a.src, a.count) == Kind::kNone) return outside(a.src, a.count);
      out->results.resize(a.count);
      out->status = cudaMemcpy(out->results.data(), reinterpret_cast<const void*>(a.src), a.count, cudaMemcpyDefault);
      return;
    }
    case Call::kMemcpy:
    case Call::kMemcpyAsync: {
      MemcpyAddresses a;
      if (!take(name, args, nargs, &a, out)) return;
      if (state_.memory.kind_of(a.dst, a.count) == Kind::kNone) return outside(a.dst, a.count);
      if (state_.memory.kind_of(a.src, a.count) == Kind::kNone) return outside(a.src, a.count);
      if (a.kind < cudaMemcpyHostToHost || a.kind > cudaMemcpyDefault)
        return fail(out, cudaErrorInvalidMemcpyDirection, std::string(name) + ": invalid kind " + std::to_string(a.kind));
      auto* dst = reinterpret_cast<void*>(a.dst);
      auto* src = reinterpret_cast<const void*>(a.src);
      const auto kind = static_cast<cudaMemcpyKind>(a.kind);
      if (call == Call::kMemcpy) {
        out->status = cudaMemcpy(dst, src, a.count, kind);
        return;
      }
      cudaStream_t s;
      if (stream_of(a.stream, &s)) out->status = cudaMemcpyAsync(dst, src, a.count, kind, s);
      return;
    }
    case Call::kMemcpyToDeviceAsync: {
      MemcpyInline a;
      if (!take(name, args, nargs, &a, out, true)) return;
      if (!payload_is(a.count, sizeof a)) return;
      if (state_.memory.kind_of(a.device, a.count) == Kind::kNone) return outside(a.device, a.count);
      cudaStream_t s;
      // The source is pageable here (the ring): the runtime stages it before returning, as CUDA does.
      if (stream_of(a.stream, &s))
        out->status = cudaMemcpyAsync(reinterpret_cast<void*>(a.device), args + sizeof a, a.count,
                                      cudaMemcpyHostToDevice, s);
      return;
    }
    case Call::kMemcpyFromDeviceAsync: {
      MemcpyInline a;
      if (!take(name, args, nargs, &a, out)) return;
      if (state_.memory.kind_of(a.device, a.count) == Kind::kNone) return outside(a.device, a.count);
      cudaStream_t s;
      if (!stream_of(a.stream, &s)) return;
      // A pageable destination: the runtime returns once the stream has done the copy.
      out->results.resize(a.count);
      out->status = cudaMemcpyAsync(out->results.data(), reinterpret_cast<const void*>(a.device), a.count,
                                    cudaMemcpyDeviceToHost, s);
      return;
    }
    case Call::kMemset: {
      Memset a;
      if (!take(name, args, nargs, &a, out)) return;
      if (state_.memory.kind_of(a.dst, a.count) != Kind::kDevice) return outside(a.dst, a.count);
      out->status = cudaMemset(reinterpret_cast<void*>(a.dst), a.value, a.count);
      return;
    }
    case Call::kHostAlloc:
      return host_alloc(args, nargs, out);
    case Call::kHostFree: {
      PointerArg a;
      if (take(name, args, nargs, &a, out)) host_free(a.ptr, out);
      return;
    }
    case Call::kRegisterModule:
      return register_module(args, nargs, out);
    case Call::kRegisterKernel:
      return register_kernel(args, nargs, out);
    case Call::kLaunchKernel:
      return launch_kernel(args, nargs, out);
    case Call::kKernelAttribute:
      return kernel_attribute(args, nargs, out);
    case Call::kSaveDevice:
    case Call::kRestoreDevice:
      return copy_device(call == Call::kSaveDevice, args, nargs, out);
    case Call::kFence: {
      FenceArg a;
      if (!take(name, args, nargs, &a, out)) return;
      state_.fence_on_nccl_failure = a.on != 0;
      out->status = cudaSuccess;
      return;
    }
    case Call::kCloseChannel:
      break;  // the channel's loop (proxy_main.cc) ends it before a dispatcher sees it
  }
  fail(out, cudaErrorNotSupported, std::string(name) + ": not served by this proxy");
}

void CallDispatcher::register_module(const uint8_t* args, size_t nargs, Outcome* out) {
  RegisterModule m;
  if (!take("module registration", args, nargs, &m, out)) return;
  const int fd = state_.mailbox.take(m.token, std::chrono::milliseconds(kFdWaitMs));
  if (fd < 0) return fail(out, cudaErrorInvalidValue, "module registration: the client's memfd did not arrive");
  std::string error;
  const int64_t id = state_.kernels.add_module(fd, m, &error);
  if (id < 0) return fail(out, cudaErrorInvalidKernelImage, error);
  out->result(static_cast<uint32_t>(id));
}

void CallDispatcher::register_kernel(const uint8_t* args, size_t nargs, Outcome* out) {
  KernelRef ref;
  if (!take("kernel registration", args, nargs, &ref, out)) return;
  uint32_t id = 0;
  std::string error;
  int status = 0;
  const KernelModules::Kernel* k = state_.kernels.resolve(ref, &id, &error, &status);
  if (k == nullptr) return fail(out, static_cast<cudaError_t>(status), error);
  out->result(KernelInfo{id, static_cast<uint32_t>(k->params.size())});
  for (const KernelParam& p : k->params) out->result(p);
}

void CallDispatcher::launch_kernel(const uint8_t* args, size_t nargs, Outcome* out) {
  LaunchKernel a;
  if (!take("cudaLaunchKernel", args, nargs, &a, out, true)) return;
  const KernelModules::Kernel* kp = state_.kernels.kernel(a.kernel_id);
  if (kp == nullptr)
    return fail(out, cudaErrorInvalidDeviceFunction, "cudaLaunchKernel: unknown kernel id " + std::to_string(a.kernel_id));
  const KernelModules::Kernel& k = *kp;
  if (a.param_bytes != k.param_bytes || nargs - sizeof a != a.param_bytes)
    return fail(out, cudaErrorInvalidValue, "cudaLaunchKernel(" + k.name + "): " + std::to_string(nargs - sizeof a) +
                                                " parameter bytes, the kernel takes " + std::to_string(k.param_bytes));
  cudaStream_t stream;
  if (!state_.handles.resolve(a.stream, &stream))
    return fail(out, cudaErrorInvalidResourceHandle, "cudaLaunchKernel(" + k.name + "): unknown stream handle " + hex(a.stream));
  // Aligned copy of the parameters; the runtime copies them again before returning.
  alignas(16) uint8_t stack_buf[512];
  std::vector<uint8_t> heap_buf;
  uint8_t* buf = stack_buf;
  if (a.param_bytes > sizeof stack_buf) {
    heap_buf.resize(a.param_bytes + 16);
    buf = heap_buf.data() + (16 - reinterpret_cast<uintptr_t>(heap_buf.data()) % 16) % 16;
  }
  if (a.param_bytes) std::memcpy(buf, args + sizeof a, a.param_bytes);
  void* slots[64];
  std::vector<void*> many;
  void** slot = slots;
  if (k.params.size() > 64) {
    many.resize(k.params.size());
    slot = many.data();
  }
  for (size_t i = 0; i < k.params.size(); ++i) slot[i] = buf + k.params[i].offset;
  out->status = cudaLaunchKernel(k.stand_in.get(), dim3(a.grid[0], a.grid[1], a.grid[2]),
                                 dim3(a.block[0], a.block[1], a.block[2]), slot, a.shared_mem, stream);
  if (out->status != cudaSuccess)
    out->error = "cudaLaunchKernel(" + k.name + "): " + cudaGetErrorName(static_cast<cudaError_t>(out->status));
}

void CallDispatcher::kernel_attribute(const uint8_t* args, size_t nargs, Outcome* out) {
  KernelAttribute a;
  if (!take("kernel attribute", args, nargs, &a, out)) return;
  const KernelModules::Kernel* k = state_.kernels.kernel(a.kernel_id);
  if (k == nullptr)
    return fail(out, cudaErrorInvalidDeviceFunction, "kernel attribute: unknown kernel id " + std::to_string(a.kernel_id));
  const void* fn = k->stand_in.get();
  // cudaFuncAttribute's enumerators, checked before the runtime sees the value (see generic_call.h).
  const bool set = a.op == KernelAttribute::kSet || a.op == KernelAttribute::kSetForDevice;
  if (set && (a.attribute < 0 || a.attribute >= cudaFuncAttributeMax))
    return fail(out, cudaErrorInvalidValue, "kernel attribute: invalid cudaFuncAttribute " + std::to_string(a.attribute));
  switch (a.op) {
    case KernelAttribute::kGet: {
      cudaFuncAttributes attr{};
      out->status = cudaFuncGetAttributes(&attr, fn);
      return out->result(attr);
    }
    case KernelAttribute::kSet:
      out->status = cudaFuncSetAttribute(fn, static_cast<cudaFuncAttribute>(a.attribute), a.value);
      return;
    case KernelAttribute::kSetForDevice: {
      cudaKernel_t k = nullptr;
      out->status = __cudaGetKernel(&k, fn);
      if (out->status == cudaSuccess)
        out->status = cudaKernelSetAttributeForDevice(k, static_cast<cudaFuncAttribute>(a.attribute), a.value, a.device);
      return;
    }
    case KernelAttribute::kOccupancy: {
      int n = 0;
      out->status = cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(&n, fn, a.attribute, a.shared_mem,
                                                                           static_cast<unsigned>(a.value));
      return out->result(int32_t{n});
    }
  }
  fail(out, cudaErrorInvalidValue, "kernel attribute: unknown operation " + std::to_string(a.op));
}

void CallDispatcher::host_alloc(const uint8_t* args, size_t nargs, Outcome* out) {
  HostAlloc a;
  if (!take("cudaHostAlloc", args, nargs, &a, out)) return;
  // The memfd came on the socket, with this request's token (the listener thread received it).
  const int fd = state_.mailbox.take(a.token, std::chrono::milliseconds(kFdWaitMs));
  if (fd < 0) return fail(out, cudaErrorMemoryAllocation, "the client's shared host memory did not arrive");
  void* want = reinterpret_cast<void*>(a.addr);
  void* got = mmap(want, a.size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED_NOREPLACE, fd, 0);
  close(fd);
  if (got != want) {
    if (got != MAP_FAILED) munmap(got, a.size);
    return fail(out, cudaErrorMemoryAllocation, "cannot map the shared host memory at " + hex(a.addr) +
                                                    " in the proxy (" + std::strerror(errno) + ")");
  }
  cudaError_t e = cudaHostRegister(want, a.size, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    munmap(want, a.size);
    return fail(out, e, std::string("registering the shared host memory with the runtime: ") + cudaGetErrorName(e));
  }
  state_.memory.add(a.addr, a.size, AddressBook::Kind::kPinned);
  out->status = cudaSuccess;
}

void CallDispatcher::copy_device(bool save, const uint8_t* args, size_t nargs, Outcome* out) {
  const char* name = save ? "device memory save" : "device memory restore";
  DeviceCopy c;
  if (!take(name, args, nargs, &c, out, true)) return;
  if (c.count > (nargs - sizeof c) / sizeof(DeviceRange) || nargs - sizeof c != c.count * sizeof(DeviceRange))
    return fail(out, cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(nargs - sizeof c) +
                                                " bytes of ranges for " + std::to_string(c.count));
  const int fd = state_.mailbox.take(c.token, std::chrono::milliseconds(kFdWaitMs));
  if (fd < 0) return fail(out, cudaErrorInvalidValue, std::string(name) + ": the client's memfd did not arrive");
  struct stat st{};
  const bool sized = fstat(fd, &st) == 0 && st.st_size > 0;
  void* map = sized ? mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                    : MAP_FAILED;
  close(fd);
  if (map == MAP_FAILED) return fail(out, cudaErrorInvalidValue, std::string(name) + ": cannot map the client's memfd");
  const auto size = static_cast<uint64_t>(st.st_size);
  // Whatever the device still has queued (the last minibatch's optimizer step) lands first;
  // unless it is blocked for good, then the copies go on a stream that waits for nothing.
  cudaStream_t stream = nullptr;
  out->status = save && c.unsynchronized ? cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)
                                         : cudaDeviceSynchronize();
  for (uint64_t i = 0; i < c.count && out->status == cudaSuccess; ++i) {
    DeviceRange r;
    std::memcpy(&r, args + sizeof c + i * sizeof r, sizeof r);
    if (state_.memory.size_of(r.base) != r.size || state_.memory.kind_of(r.base, r.size) != AddressBook::Kind::kDevice ||
        r.offset > size || r.size > size - r.offset) {
      fail(out, cudaErrorInvalidValue, std::string(name) + ": [" + hex(r.base) + ", +" + std::to_string(r.size) +
                                           ") is not a device allocation of this proxy, or not inside the memfd");
      break;
    }
    char* host = static_cast<char*>(map) + r.offset;
    auto* device = reinterpret_cast<void*>(r.base);
    if (stream != nullptr) {
      out->status = cudaMemcpyAsync(host, device, r.size, cudaMemcpyDeviceToHost, stream);
      if (out->status == cudaSuccess) out->status = cudaStreamSynchronize(stream);
    } else {
      out->status = save ? cudaMemcpy(host, device, r.size, cudaMemcpyDeviceToHost)
                         : cudaMemcpy(device, host, r.size, cudaMemcpyHostToDevice);
    }
  }
  if (stream != nullptr) cudaStreamDestroy(stream);
  munmap(map, size);
}

void CallDispatcher::host_free(uint64_t addr, Outcome* out) {
  const uint64_t size = state_.memory.size_of(addr);
  if (size == 0 || !state_.memory.remove(addr, AddressBook::Kind::kPinned))
    return fail(out, cudaErrorInvalidValue, "cudaFreeHost: " + hex(addr) + " is not pinned memory of this proxy");
  out->status = cudaHostUnregister(reinterpret_cast<void*>(addr));
  munmap(reinterpret_cast<void*>(addr), size);
}

}  // namespace jitckpt::proxy
