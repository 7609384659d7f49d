#include "memory_copy.h"

#include <cstring>
#include <memory>
#include <vector>

#include "api_support.h"

namespace simcuda {
namespace {

bool is_device(const void* p) { return Runtime::get().find_device(p).has_value(); }
bool device_range_ok(const void* p, size_t n) { return Runtime::get().device_range(p, n); }

// Resolves cudaMemcpyDefault and checks that every side declared "device" is a live device range.
cudaError_t check_directions(void* dst, const void* src, size_t count, cudaMemcpyKind* kind) {
  if (*kind == cudaMemcpyDefault) {
    const bool d = is_device(dst), s = is_device(src);
    *kind = s ? (d ? cudaMemcpyDeviceToDevice : cudaMemcpyDeviceToHost)
              : (d ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost);
  }
  switch (*kind) {
    case cudaMemcpyHostToHost: return cudaSuccess;
    case cudaMemcpyHostToDevice: return device_range_ok(dst, count) ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost: return device_range_ok(src, count) ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice:
      return device_range_ok(src, count) && device_range_ok(dst, count) ? cudaSuccess : cudaErrorInvalidValue;
    default: return cudaErrorInvalidMemcpyDirection;
  }
}

bool pageable(const void* p) { return !is_device(p) && !Runtime::get().pinned().contains(p); }

cudaError_t run_on_stream(cudaStream_t handle, bool per_thread, Stream::Op op, bool wait) {
  Runtime& rt = Runtime::get();
  auto stream = rt.resolve_stream(handle, per_thread);
  if (!stream) return cudaErrorInvalidResourceHandle;
  const uint64_t seq = rt.device(stream->device()).submit(stream, std::move(op));
  if (wait) {
    stream->wait_until(seq);
    return after_wait();
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t copy_memory(const CopyRequest& req) {
  SIMCUDA_RETURN_IF_STICKY();
  if (req.count == 0) return cudaSuccess;
  if (!req.dst || !req.src) return api_result(cudaErrorInvalidValue);
  cudaMemcpyKind kind = req.kind;
  if (cudaError_t e = check_directions(req.dst, req.src, req.count, &kind); e != cudaSuccess) return api_result(e);
  void* dst = req.dst;
  const size_t n = req.count;
  bool wait = req.sync == HostSync::Sync;
  Stream::Op op;
  if (req.sync == HostSync::Async && kind == cudaMemcpyHostToDevice && pageable(req.src)) {
    // CUDA stages pageable sources before returning, so the caller may reuse the buffer at once.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(req.src),
                                                      static_cast<const char*>(req.src) + n);
    op = [dst, staged] { std::memcpy(dst, staged->data(), staged->size()); };
  } else {
    const void* src = req.src;
    op = [dst, src, n] { std::memmove(dst, src, n); };
    // CUDA returns from a device-to-pageable-host async copy only once the copy is done.
    if (kind == cudaMemcpyDeviceToHost && pageable(req.dst)) wait = true;
  }
  return api_result(run_on_stream(req.stream, req.per_thread_default, std::move(op), wait));
}

cudaError_t copy_memory_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                           cudaMemcpyKind kind, cudaStream_t stream, HostSync sync, bool per_thread_default) {
  SIMCUDA_RETURN_IF_STICKY();
  if (width == 0 || height == 0) return cudaSuccess;
  if (width > dpitch || width > spitch || !dst || !src) return api_result(cudaErrorInvalidPitchValue);
  const size_t dspan = dpitch * (height - 1) + width, sspan = spitch * (height - 1) + width;
  cudaMemcpyKind k = kind;
  if (cudaError_t e = check_directions(dst, src, 1, &k); e != cudaSuccess) return api_result(e);
  if ((k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice) && !device_range_ok(dst, dspan))
    return api_result(cudaErrorInvalidValue);
  if ((k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice) && !device_range_ok(src, sspan))
    return api_result(cudaErrorInvalidValue);
  auto op = [=] {
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
  };
  return api_result(run_on_stream(stream, per_thread_default, op, sync == HostSync::Sync));
}

cudaError_t set_memory(void* dst, int value, size_t count, cudaStream_t stream, HostSync sync,
                       bool per_thread_default) {
  SIMCUDA_RETURN_IF_STICKY();
  if (count == 0) return cudaSuccess;
  if (!device_range_ok(dst, count)) return api_result(cudaErrorInvalidValue);
  auto op = [dst, value, count] { std::memset(dst, value, count); };
  return api_result(run_on_stream(stream, per_thread_default, op, sync == HostSync::Sync));
}

}  // namespace simcuda
