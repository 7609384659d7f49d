// Interposed CUDA runtime entry points. Steady state: learn the stream graph (lock-free) and pass
// through. While the JIT save runs: move the save threads' device work to the save stream (see
// save_redirect.h).
// Symbols are defined unversioned; glibc binds versioned references (cudaX@libcudart.so.13, as
// torch imports them) to an unversioned definition of an LD_PRELOADed object.
#include <cuda_runtime_api.h>

#include <cstdio>

#include "blocking_call.h"
#include "device_fault.h"
#include "diagnostics.h"
#include "real_api.h"
#include "registry.h"

using jitckpt::BlockingCallScope;
using jitckpt::is_device_fault;
using jitckpt::NextSymbol;
using jitckpt::real_cuda;
using jitckpt::Registry;

namespace {

constexpr cudaError_t kMissing = cudaErrorSharedObjectSymbolNotFound;

// During the save: wait for the save stream only; every stream the save used was redirected to it.
cudaError_t synchronize_save_stream(Registry& r) {
  BlockingCallScope blocking;
  auto sync = real_cuda.streamSynchronize.get();
  return sync ? sync(r.redirect().stream()) : kMissing;
}

__attribute__((noinline)) void report_device_fault(const char* call, cudaError_t e) {
  auto name = real_cuda.getErrorName.get();
  char detail[160];
  std::snprintf(detail, sizeof detail, "%s returned %s", call, name ? name(e) : "a device fault");
  Registry::instance().report_failure_and_hold("cuda_error", detail);
}

// An interposed call returned a device fault: report it before the application sees it.
// Only the rare failure path touches the registry (cudaGetLastError runs after every torch kernel).
inline __attribute__((always_inline)) cudaError_t checked(const char* call, cudaError_t e) {
  if (__builtin_expect(e != cudaSuccess, 0) && is_device_fault(e)) report_device_fault(call, e);
  return e;
}

// One implementation per entry point, shared by the legacy-default-stream name and its
// per-thread-default-stream twin (_ptsz/_ptds, used by code built with --default-stream per-thread).
template <typename Fn>
cudaError_t event_record(NextSymbol<Fn>& next, cudaEvent_t event, cudaStream_t stream) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) {
    stream = r.redirect().stream();
  } else {
    r.graph().note_event_record(event, stream);
  }
  auto fn = next.get();
  return fn ? checked("cudaEventRecord", fn(event, stream)) : kMissing;
}

template <typename Fn>
cudaError_t event_record_with_flags(NextSymbol<Fn>& next, cudaEvent_t event, cudaStream_t stream,
                                    unsigned int flags) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) {
    stream = r.redirect().stream();
  } else {
    r.graph().note_event_record(event, stream);
  }
  auto fn = next.get();
  return fn ? checked("cudaEventRecordWithFlags", fn(event, stream, flags)) : kMissing;
}

template <typename Fn>
cudaError_t stream_wait_event(NextSymbol<Fn>& next, cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) {
    // All save work is in order on the save stream; a wait could only add the hung dependency.
    jitckpt::log_verbose("save: dropped cudaStreamWaitEvent(%p, %p)", static_cast<void*>(stream),
                         static_cast<void*>(event));
    return cudaSuccess;
  }
  r.graph().note_stream_wait(stream, event);
  auto fn = next.get();
  return fn ? checked("cudaStreamWaitEvent", fn(stream, event, flags)) : kMissing;
}

template <typename Fn>
cudaError_t stream_synchronize(NextSymbol<Fn>& next, cudaStream_t stream) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) return synchronize_save_stream(r);
  auto fn = next.get();
  BlockingCallScope blocking;
  return fn ? checked("cudaStreamSynchronize", fn(stream)) : kMissing;
}

template <typename Fn>
cudaError_t memcpy_sync(NextSymbol<Fn>& next, void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) {
    auto async = real_cuda.memcpyAsync.get();
    if (async == nullptr) return kMissing;
    cudaError_t st = async(dst, src, count, kind, r.redirect().stream());
    return st != cudaSuccess ? st : synchronize_save_stream(r);
  }
  auto fn = next.get();
  BlockingCallScope blocking;
  return fn ? checked("cudaMemcpy", fn(dst, src, count, kind)) : kMissing;
}

// Calls that only take a stream to enqueue on: redirected during the save, otherwise untouched.
template <typename Fn, typename... Args>
cudaError_t enqueue(const char* call, NextSymbol<Fn>& next, cudaStream_t stream, Args... args_before_stream) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) stream = r.redirect().stream();
  auto fn = next.get();
  return fn ? checked(call, fn(args_before_stream..., stream)) : kMissing;
}

}  // namespace

// Exported (the library is built with -fvisibility=hidden).
#pragma GCC visibility push(default)
extern "C" {

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return event_record(real_cuda.eventRecord, event, stream);
}
cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
  return event_record(real_cuda.eventRecord_ptsz, event, stream);
}

cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return event_record_with_flags(real_cuda.eventRecordWithFlags, event, stream, flags);
}
cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return event_record_with_flags(real_cuda.eventRecordWithFlags_ptsz, event, stream, flags);
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(real_cuda.streamWaitEvent, stream, event, flags);
}
cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(real_cuda.streamWaitEvent_ptsz, stream, event, flags);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  return stream_synchronize(real_cuda.streamSynchronize, stream);
}
cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) {
  return stream_synchronize(real_cuda.streamSynchronize_ptsz, stream);
}

cudaError_t cudaDeviceSynchronize(void) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) return synchronize_save_stream(r);
  auto fn = real_cuda.deviceSynchronize.get();
  BlockingCallScope blocking;
  return fn ? checked("cudaDeviceSynchronize", fn()) : kMissing;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  Registry& r = Registry::instance();
  if (__builtin_expect(r.redirect().applies_here(), 0)) {
    // Events the save recorded are on the save stream; others may belong to the hung work, so
    // report their state instead of blocking forever.
    cudaError_t st = synchronize_save_stream(r);
    if (st != cudaSuccess) return st;
    auto query = real_cuda.eventQuery.get();
    return query ? query(event) : kMissing;
  }
  auto fn = real_cuda.eventSynchronize.get();
  BlockingCallScope blocking;
  return fn ? checked("cudaEventSynchronize", fn(event)) : kMissing;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  return memcpy_sync(real_cuda.memcpy, dst, src, count, kind);
}
cudaError_t cudaMemcpy_ptds(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  return memcpy_sync(real_cuda.memcpy_ptds, dst, src, count, kind);
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return enqueue("cudaMemcpyAsync", real_cuda.memcpyAsync, stream, dst, src, count, kind);
}
cudaError_t cudaMemcpyAsync_ptsz(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                                 cudaStream_t stream) {
  return enqueue("cudaMemcpyAsync", real_cuda.memcpyAsync_ptsz, stream, dst, src, count, kind);
}

cudaError_t cudaMemsetAsync(void* dst, int value, size_t count, cudaStream_t stream) {
  return enqueue("cudaMemsetAsync", real_cuda.memsetAsync, stream, dst, value, count);
}
cudaError_t cudaMemsetAsync_ptsz(void* dst, int value, size_t count, cudaStream_t stream) {
  return enqueue("cudaMemsetAsync", real_cuda.memsetAsync_ptsz, stream, dst, value, count);
}

cudaError_t cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shared_mem,
                             cudaStream_t stream) {
  return enqueue("cudaLaunchKernel", real_cuda.launchKernel, stream, func, grid, block, args, shared_mem);
}
cudaError_t cudaLaunchKernel_ptsz(const void* func, dim3 grid, dim3 block, void** args, size_t shared_mem,
                                  cudaStream_t stream) {
  return enqueue("cudaLaunchKernel", real_cuda.launchKernel_ptsz, stream, func, grid, block, args, shared_mem);
}

// What nvcc 13 generated launch stubs (<<<...>>>) call.
cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shared_mem,
                               cudaStream_t stream) {
  return enqueue("cudaLaunchKernel", real_cuda.internalLaunchKernel, stream, kernel, grid, block, args, shared_mem);
}
cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 grid, dim3 block, void** args, size_t shared_mem,
                                    cudaStream_t stream) {
  return enqueue("cudaLaunchKernel", real_cuda.internalLaunchKernel_ptsz, stream, kernel, grid, block, args, shared_mem);
}

// A device fault set asynchronously (sticky on a GPU) is often first seen here, e.g. by the launch
// check after a kernel (torch's C10_CUDA_KERNEL_LAUNCH_CHECK).
cudaError_t cudaGetLastError(void) {
  auto fn = real_cuda.getLastError.get();
  return fn ? checked("cudaGetLastError", fn()) : kMissing;
}
cudaError_t cudaPeekAtLastError(void) {
  auto fn = real_cuda.peekAtLastError.get();
  return fn ? checked("cudaPeekAtLastError", fn()) : kMissing;
}

}  // extern "C"
#pragma GCC visibility pop
