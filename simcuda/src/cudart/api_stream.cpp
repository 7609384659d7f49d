// Streams, host callbacks, stream capture queries (capture itself is unsupported).
#include "api_support.h"

using simcuda::api_result;
using simcuda::Runtime;
using simcuda::Stream;

namespace {
cudaError_t create(cudaStream_t* out, unsigned flags, int priority) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!out || (flags & ~static_cast<unsigned>(cudaStreamNonBlocking))) return api_result(cudaErrorInvalidValue);
  priority = priority > 0 ? 0 : (priority < -5 ? -5 : priority);  // clamp like CUDA does
  Runtime& rt = Runtime::get();
  *out = rt.add_stream(rt.current().create_stream(Stream::Kind::User, flags, priority));
  return cudaSuccess;
}

cudaError_t synchronize(cudaStream_t handle, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  auto s = Runtime::get().resolve_stream(handle, ptsz);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  s->wait_until(s->last_enqueued());
  return simcuda::after_wait();
}

cudaError_t query(cudaStream_t handle, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  auto s = Runtime::get().resolve_stream(handle, ptsz);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  return s->reached(s->last_enqueued()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t wait_event(cudaStream_t handle, cudaEvent_t event, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  auto s = rt.resolve_stream(handle, ptsz);
  auto e = rt.find_event(event);
  if (!s || !e) return api_result(cudaErrorInvalidResourceHandle);
  auto m = e->marker();
  if (!m || m->complete()) return cudaSuccess;  // never-recorded or finished events impose no wait
  rt.device(s->device()).submit(s, [m] { m->stream->wait_until(m->seq); });
  return cudaSuccess;
}

cudaError_t host_func(cudaStream_t handle, cudaHostFn_t fn, void* data, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!fn) return api_result(cudaErrorInvalidValue);
  Runtime& rt = Runtime::get();
  auto s = rt.resolve_stream(handle, ptsz);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  rt.device(s->device()).submit(s, [fn, data] { fn(data); });
  return cudaSuccess;
}

cudaError_t add_callback(cudaStream_t handle, cudaStreamCallback_t cb, void* data, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  if (!cb) return api_result(cudaErrorInvalidValue);
  Runtime& rt = Runtime::get();
  auto s = rt.resolve_stream(handle, ptsz);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  rt.device(s->device()).submit(s, [cb, data, handle] { cb(handle, Runtime::get().errors().sticky(), data); });
  return cudaSuccess;
}

template <typename F>
cudaError_t with_stream(cudaStream_t handle, bool ptsz, F f) {
  SIMCUDA_RETURN_IF_STICKY();
  auto s = Runtime::get().resolve_stream(handle, ptsz);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  f(*s);
  return cudaSuccess;
}
}  // namespace

SIMCUDA_API cudaError_t cudaStreamCreate(cudaStream_t* s) { return create(s, cudaStreamDefault, 0); }
SIMCUDA_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int f) { return create(s, f, 0); }
SIMCUDA_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int f, int p) { return create(s, f, p); }

SIMCUDA_API cudaError_t cudaStreamDestroy(cudaStream_t handle) {
  SIMCUDA_RETURN_IF_STICKY();
  auto s = Runtime::get().remove_stream(handle);
  if (!s) return api_result(cudaErrorInvalidResourceHandle);
  s->close();  // pending work still runs, as in CUDA
  return cudaSuccess;
}

SIMCUDA_API cudaError_t cudaStreamSynchronize(cudaStream_t s) { return synchronize(s, false); }
SIMCUDA_API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t s) { return synchronize(s, true); }
SIMCUDA_API cudaError_t cudaStreamQuery(cudaStream_t s) { return query(s, false); }
SIMCUDA_API cudaError_t cudaStreamQuery_ptsz(cudaStream_t s) { return query(s, true); }
SIMCUDA_API cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) { return wait_event(s, e, false); }
SIMCUDA_API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t s, cudaEvent_t e, unsigned int) {
  return wait_event(s, e, true);
}
SIMCUDA_API cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* d) { return host_func(s, fn, d, false); }
SIMCUDA_API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t s, cudaHostFn_t fn, void* d) {
  return host_func(s, fn, d, true);
}
SIMCUDA_API cudaError_t cudaStreamAddCallback(cudaStream_t s, cudaStreamCallback_t cb, void* d, unsigned int) {
  return add_callback(s, cb, d, false);
}
SIMCUDA_API cudaError_t cudaStreamAddCallback_ptsz(cudaStream_t s, cudaStreamCallback_t cb, void* d, unsigned int) {
  return add_callback(s, cb, d, true);
}

SIMCUDA_API cudaError_t cudaStreamGetPriority(cudaStream_t h, int* p) {
  if (!p) return api_result(cudaErrorInvalidValue);
  return with_stream(h, false, [p](Stream& s) { *p = s.priority(); });
}
SIMCUDA_API cudaError_t cudaStreamGetPriority_ptsz(cudaStream_t h, int* p) {
  if (!p) return api_result(cudaErrorInvalidValue);
  return with_stream(h, true, [p](Stream& s) { *p = s.priority(); });
}
SIMCUDA_API cudaError_t cudaStreamGetFlags(cudaStream_t h, unsigned int* f) {
  if (!f) return api_result(cudaErrorInvalidValue);
  return with_stream(h, false, [f](Stream& s) { *f = s.flags(); });
}
SIMCUDA_API cudaError_t cudaStreamGetFlags_ptsz(cudaStream_t h, unsigned int* f) {
  if (!f) return api_result(cudaErrorInvalidValue);
  return with_stream(h, true, [f](Stream& s) { *f = s.flags(); });
}
SIMCUDA_API cudaError_t cudaStreamGetDevice(cudaStream_t h, int* d) {
  if (!d) return api_result(cudaErrorInvalidValue);
  return with_stream(h, false, [d](Stream& s) { *d = s.device(); });
}
SIMCUDA_API cudaError_t cudaStreamGetDevice_ptsz(cudaStream_t h, int* d) {
  if (!d) return api_result(cudaErrorInvalidValue);
  return with_stream(h, true, [d](Stream& s) { *d = s.device(); });
}
SIMCUDA_API cudaError_t cudaStreamGetId(cudaStream_t h, unsigned long long* id) {
  if (!id) return api_result(cudaErrorInvalidValue);
  return with_stream(h, false, [id](Stream& s) { *id = reinterpret_cast<uintptr_t>(&s); });
}

// Stream capture is not simulated: nothing is ever capturing, and starting a capture fails.
SIMCUDA_API cudaError_t cudaStreamIsCapturing(cudaStream_t h, cudaStreamCaptureStatus* st) {
  if (!st) return api_result(cudaErrorInvalidValue);
  return with_stream(h, false, [st](Stream&) { *st = cudaStreamCaptureStatusNone; });
}
SIMCUDA_API cudaError_t cudaStreamIsCapturing_ptsz(cudaStream_t h, cudaStreamCaptureStatus* st) {
  if (!st) return api_result(cudaErrorInvalidValue);
  return with_stream(h, true, [st](Stream&) { *st = cudaStreamCaptureStatusNone; });
}
SIMCUDA_API cudaError_t cudaStreamGetCaptureInfo(cudaStream_t h, cudaStreamCaptureStatus* st, unsigned long long* id,
                                                 cudaGraph_t* graph, const cudaGraphNode_t** deps,
                                                 const cudaGraphEdgeData** edges, size_t* n) {
  if (!st) return api_result(cudaErrorInvalidValue);
  if (id) *id = 0;
  if (graph) *graph = nullptr;
  if (deps) *deps = nullptr;
  if (edges) *edges = nullptr;
  if (n) *n = 0;
  return with_stream(h, false, [st](Stream&) { *st = cudaStreamCaptureStatusNone; });
}
SIMCUDA_API cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  if (!mode) return api_result(cudaErrorInvalidValue);
  static thread_local cudaStreamCaptureMode current = cudaStreamCaptureModeGlobal;
  std::swap(current, *mode);
  return cudaSuccess;
}
