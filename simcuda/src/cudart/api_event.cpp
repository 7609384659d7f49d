// Events: record / query / synchronize / elapsed time.
#include <chrono>

#include "api_support.h"

using simcuda::api_result;
using simcuda::Event;
using simcuda::EventMarker;
using simcuda::Runtime;

namespace {
cudaError_t create(cudaEvent_t* out, unsigned flags) {
  SIMCUDA_RETURN_IF_STICKY();
  constexpr unsigned kKnown = cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess;
  if (!out || (flags & ~kKnown)) return api_result(cudaErrorInvalidValue);
  Runtime& rt = Runtime::get();
  *out = rt.add_event(std::make_shared<Event>(rt.current_device(), flags));
  return cudaSuccess;
}

cudaError_t record(cudaEvent_t event, cudaStream_t handle, bool ptsz) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  auto e = rt.find_event(event);
  auto s = rt.resolve_stream(handle, ptsz);
  if (!e || !s) return api_result(cudaErrorInvalidResourceHandle);
  auto m = std::make_shared<EventMarker>();
  m->stream = s;
  // The marker op only timestamps; completion itself is the stream reaching m->seq. It holds the
  // marker weakly: re-recording or destroying the event before the stream gets there is legal, and
  // then nobody can ask for this recording's time.
  std::weak_ptr<EventMarker> weak = m;
  m->seq = rt.device(s->device()).submit(s, [weak] {
    if (auto marker = weak.lock()) {
      std::lock_guard<std::mutex> lock(marker->mu);
      marker->at = std::chrono::steady_clock::now();
    }
  });
  e->set_marker(std::move(m));
  return cudaSuccess;
}
}  // namespace

SIMCUDA_API cudaError_t cudaEventCreate(cudaEvent_t* e) { return create(e, cudaEventDefault); }
SIMCUDA_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int f) { return create(e, f); }

SIMCUDA_API cudaError_t cudaEventDestroy(cudaEvent_t event) {
  SIMCUDA_RETURN_IF_STICKY();
  return api_result(Runtime::get().remove_event(event) ? cudaSuccess : cudaErrorInvalidResourceHandle);
}

SIMCUDA_API cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) { return record(e, s, false); }
SIMCUDA_API cudaError_t cudaEventRecord_ptsz(cudaEvent_t e, cudaStream_t s) { return record(e, s, true); }
SIMCUDA_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned int) { return record(e, s, false); }
SIMCUDA_API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t e, cudaStream_t s, unsigned int) {
  return record(e, s, true);
}

SIMCUDA_API cudaError_t cudaEventQuery(cudaEvent_t event) {
  SIMCUDA_RETURN_IF_STICKY();
  auto e = Runtime::get().find_event(event);
  if (!e) return api_result(cudaErrorInvalidResourceHandle);
  auto m = e->marker();
  return !m || m->complete() ? cudaSuccess : cudaErrorNotReady;
}

SIMCUDA_API cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  SIMCUDA_RETURN_IF_STICKY();
  auto e = Runtime::get().find_event(event);
  if (!e) return api_result(cudaErrorInvalidResourceHandle);
  if (auto m = e->marker()) m->stream->wait_until(m->seq);
  return simcuda::after_wait();
}

SIMCUDA_API cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  SIMCUDA_RETURN_IF_STICKY();
  Runtime& rt = Runtime::get();
  if (!ms) return api_result(cudaErrorInvalidValue);
  auto a = rt.find_event(start), b = rt.find_event(end);
  if (!a || !b || a->timing_disabled() || b->timing_disabled()) return api_result(cudaErrorInvalidResourceHandle);
  auto ma = a->marker(), mb = b->marker();
  if (!ma || !mb) return api_result(cudaErrorInvalidResourceHandle);
  if (!ma->complete() || !mb->complete()) return api_result(cudaErrorNotReady);
  std::lock_guard<std::mutex> la(ma->mu);
  std::unique_lock<std::mutex> lb(mb->mu, std::defer_lock);
  if (mb.get() != ma.get()) lb.lock();
  *ms = std::chrono::duration<float, std::milli>(*mb->at - *ma->at).count();
  return cudaSuccess;
}
