#include "call_dispatcher.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <string>

namespace jitckpt::proxy {

namespace {

// Reply builder: the head first, results appended.
struct Reply {
  std::vector<uint8_t>* out;
  ReplyHead head{};

  Reply(std::vector<uint8_t>* o, uint64_t seq) : out(o) {
    head.seq = seq;
    out->assign(sizeof(ReplyHead), 0);
  }
  void status(cudaError_t e) { head.status = e; }
  void fail(cudaError_t e, const std::string& why) {
    head.status = e;
    head.has_text = 1;
    std::snprintf(head.text, sizeof head.text, "%s", why.c_str());
    std::fprintf(stderr, "jitckpt-proxy: %s\n", head.text);
  }
  template <typename T>
  void append(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    out->insert(out->end(), p, p + sizeof v);
  }
  ~Reply() { std::memcpy(out->data(), &head, sizeof head); }
};

}  // namespace

bool CallDispatcher::owns(uint64_t ptr, uint64_t count) const {
  auto it = allocations_.upper_bound(ptr);
  if (it == allocations_.begin()) return false;
  --it;
  return ptr >= it->first && count <= it->second && ptr - it->first <= it->second - count;
}

void CallDispatcher::handle(uint32_t call, const uint8_t* data, size_t len, std::vector<uint8_t>* out) {
  RequestHead req{};
  if (len >= sizeof req) std::memcpy(&req, data, sizeof req);
  Reply reply(out, req.seq);
  const char* name = call_name(call);
  if (name == nullptr) return reply.fail(cudaErrorNotSupported, "unknown call " + std::to_string(call));
  if (len < sizeof req) return reply.fail(cudaErrorInvalidValue, std::string(name) + ": truncated request");
  const uint8_t* args = data + sizeof req;
  const size_t nargs = len - sizeof req;
  // Copies the fixed arguments out of the ring once (the writer is another process) and checks
  // their size; `extra` allows trailing bytes (a memcpy's payload).
  auto take = [&](auto* v, bool extra = false) {
    if (nargs < sizeof *v || (!extra && nargs != sizeof *v)) {
      reply.fail(cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(nargs) +
                                            " argument bytes, expected " + std::to_string(sizeof *v));
      return false;
    }
    std::memcpy(v, args, sizeof *v);
    return true;
  };
  switch (static_cast<Call>(call)) {
    case Call::kGetDeviceCount: {
      int n = 0;
      reply.status(cudaGetDeviceCount(&n));
      reply.append(int32_t{n});
      return;
    }
    case Call::kGetDevice: {
      int d = 0;
      reply.status(cudaGetDevice(&d));
      reply.append(int32_t{d});
      return;
    }
    case Call::kSetDevice: {
      DeviceArg a;
      if (take(&a)) reply.status(cudaSetDevice(a.device));
      return;
    }
    case Call::kMalloc: {
      SizeArg a;
      if (!take(&a)) return;
      void* p = nullptr;
      cudaError_t e = cudaMalloc(&p, a.size);
      if (e == cudaSuccess) allocations_[reinterpret_cast<uint64_t>(p)] = a.size;
      reply.status(e);
      reply.append(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)));
      return;
    }
    case Call::kFree: {
      PointerArg a;
      if (!take(&a)) return;
      if (a.ptr == 0) return reply.status(cudaFree(nullptr));
      auto it = allocations_.find(a.ptr);
      if (it == allocations_.end())
        return reply.fail(cudaErrorInvalidValue, "cudaFree: " + std::to_string(a.ptr) +
                                                     " is not a device allocation of this proxy");
      cudaError_t e = cudaFree(reinterpret_cast<void*>(a.ptr));
      if (e == cudaSuccess) allocations_.erase(it);
      return reply.status(e);
    }
    case Call::kMemcpyToDevice: {
      MemcpyToDevice a;
      if (!take(&a, true)) return;
      if (a.count != nargs - sizeof a)
        return reply.fail(cudaErrorInvalidValue, std::string(name) + ": " + std::to_string(nargs - sizeof a) +
                                                     " payload bytes for a copy of " + std::to_string(a.count));
      if (!owns(a.dst, a.count))
        return reply.fail(cudaErrorInvalidValue, std::string(name) + ": [" + std::to_string(a.dst) + ", +" +
                                                     std::to_string(a.count) + ") is outside the device arena");
      return reply.status(cudaMemcpy(reinterpret_cast<void*>(a.dst), args + sizeof a, a.count,
                                     cudaMemcpyHostToDevice));
    }
    case Call::kMemcpyFromDevice: {
      MemcpyFromDevice a;
      if (!take(&a)) return;
      if (!owns(a.src, a.count))
        return reply.fail(cudaErrorInvalidValue, std::string(name) + ": [" + std::to_string(a.src) + ", +" +
                                                     std::to_string(a.count) + ") is outside the device arena");
      const size_t at = out->size();
      out->resize(at + a.count);
      return reply.status(cudaMemcpy(out->data() + at, reinterpret_cast<const void*>(a.src), a.count,
                                     cudaMemcpyDeviceToHost));
    }
    case Call::kDeviceSynchronize:
      if (nargs != 0) return reply.fail(cudaErrorInvalidValue, std::string(name) + ": unexpected arguments");
      return reply.status(cudaDeviceSynchronize());
  }
}

}  // namespace jitckpt::proxy
