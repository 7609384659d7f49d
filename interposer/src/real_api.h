// The next (real) definitions of every CUDA runtime and NCCL entry point libjit.so interposes or
// calls on its own behalf. Constant-initialized, so no static-init guard on the hot path.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "next_symbol.h"

namespace jitckpt {

inline constexpr const char* kCudartSoname = "libcudart.so.13";
inline constexpr const char* kNcclSoname = "libnccl.so.2";

using LaunchKernelFn = cudaError_t (*)(const void*, dim3, dim3, void**, size_t, cudaStream_t);
using InternalLaunchKernelFn = cudaError_t (*)(cudaKernel_t, dim3, dim3, void**, size_t, cudaStream_t);

struct RealCuda {
  NextSymbol<decltype(&::cudaEventRecord)> eventRecord{"cudaEventRecord", kCudartSoname};
  NextSymbol<decltype(&::cudaEventRecordWithFlags)> eventRecordWithFlags{"cudaEventRecordWithFlags",
                                                                         kCudartSoname};
  NextSymbol<decltype(&::cudaStreamWaitEvent)> streamWaitEvent{"cudaStreamWaitEvent", kCudartSoname};
  NextSymbol<decltype(&::cudaStreamSynchronize)> streamSynchronize{"cudaStreamSynchronize", kCudartSoname};
  NextSymbol<decltype(&::cudaDeviceSynchronize)> deviceSynchronize{"cudaDeviceSynchronize", kCudartSoname};
  NextSymbol<decltype(&::cudaEventSynchronize)> eventSynchronize{"cudaEventSynchronize", kCudartSoname};
  NextSymbol<decltype(&::cudaMemcpy)> memcpy{"cudaMemcpy", kCudartSoname};
  NextSymbol<decltype(&::cudaMemcpyAsync)> memcpyAsync{"cudaMemcpyAsync", kCudartSoname};
  NextSymbol<decltype(&::cudaMemsetAsync)> memsetAsync{"cudaMemsetAsync", kCudartSoname};
  NextSymbol<LaunchKernelFn> launchKernel{"cudaLaunchKernel", kCudartSoname};
  NextSymbol<InternalLaunchKernelFn> internalLaunchKernel{"__cudaLaunchKernel", kCudartSoname};
  // Per-thread-default-stream twins (same signatures).
  NextSymbol<decltype(&::cudaEventRecord)> eventRecord_ptsz{"cudaEventRecord_ptsz", kCudartSoname};
  NextSymbol<decltype(&::cudaEventRecordWithFlags)> eventRecordWithFlags_ptsz{"cudaEventRecordWithFlags_ptsz",
                                                                              kCudartSoname};
  NextSymbol<decltype(&::cudaStreamWaitEvent)> streamWaitEvent_ptsz{"cudaStreamWaitEvent_ptsz", kCudartSoname};
  NextSymbol<decltype(&::cudaStreamSynchronize)> streamSynchronize_ptsz{"cudaStreamSynchronize_ptsz",
                                                                        kCudartSoname};
  NextSymbol<decltype(&::cudaMemcpy)> memcpy_ptds{"cudaMemcpy_ptds", kCudartSoname};
  NextSymbol<decltype(&::cudaMemcpyAsync)> memcpyAsync_ptsz{"cudaMemcpyAsync_ptsz", kCudartSoname};
  NextSymbol<decltype(&::cudaMemsetAsync)> memsetAsync_ptsz{"cudaMemsetAsync_ptsz", kCudartSoname};
  NextSymbol<decltype(&::cudaGetLastError)> getLastError{"cudaGetLastError", kCudartSoname};
  NextSymbol<decltype(&::cudaPeekAtLastError)> peekAtLastError{"cudaPeekAtLastError", kCudartSoname};
  NextSymbol<LaunchKernelFn> launchKernel_ptsz{"cudaLaunchKernel_ptsz", kCudartSoname};
  NextSymbol<InternalLaunchKernelFn> internalLaunchKernel_ptsz{"__cudaLaunchKernel_ptsz", kCudartSoname};
  // Not interposed; used by the watchdog and the save redirect.
  NextSymbol<decltype(&::cudaEventQuery)> eventQuery{"cudaEventQuery", kCudartSoname};
  NextSymbol<decltype(&::cudaEventCreateWithFlags)> eventCreateWithFlags{"cudaEventCreateWithFlags",
                                                                         kCudartSoname};
  NextSymbol<decltype(&::cudaStreamCreateWithFlags)> streamCreateWithFlags{"cudaStreamCreateWithFlags",
                                                                           kCudartSoname};
  NextSymbol<decltype(&::cudaGetDevice)> getDevice{"cudaGetDevice", kCudartSoname};
  NextSymbol<decltype(&::cudaSetDevice)> setDevice{"cudaSetDevice", kCudartSoname};
  NextSymbol<decltype(&::cudaGetErrorName)> getErrorName{"cudaGetErrorName", kCudartSoname};
  // Not interposed; used by the send log.
  NextSymbol<cudaError_t (*)(void**, size_t)> mallocHost{"cudaMallocHost", kCudartSoname};  // overloaded in C++
  NextSymbol<decltype(&::cudaStreamIsCapturing)> streamIsCapturing{"cudaStreamIsCapturing", kCudartSoname};
};

struct RealNccl {
  NextSymbol<decltype(&::ncclAllReduce)> allReduce{"ncclAllReduce", kNcclSoname};
  NextSymbol<decltype(&::ncclBroadcast)> broadcast{"ncclBroadcast", kNcclSoname};
  NextSymbol<decltype(&::ncclBcast)> bcast{"ncclBcast", kNcclSoname};
  NextSymbol<decltype(&::ncclReduce)> reduce{"ncclReduce", kNcclSoname};
  NextSymbol<decltype(&::ncclAllGather)> allGather{"ncclAllGather", kNcclSoname};
  NextSymbol<decltype(&::ncclReduceScatter)> reduceScatter{"ncclReduceScatter", kNcclSoname};
  NextSymbol<decltype(&::ncclAlltoAll)> alltoAll{"ncclAlltoAll", kNcclSoname};
  NextSymbol<decltype(&::ncclGather)> gather{"ncclGather", kNcclSoname};
  NextSymbol<decltype(&::ncclSend)> send{"ncclSend", kNcclSoname};
  NextSymbol<decltype(&::ncclRecv)> recv{"ncclRecv", kNcclSoname};
  NextSymbol<decltype(&::ncclGroupStart)> groupStart{"ncclGroupStart", kNcclSoname};
  NextSymbol<decltype(&::ncclGroupEnd)> groupEnd{"ncclGroupEnd", kNcclSoname};
  NextSymbol<decltype(&::ncclCommInitRank)> commInitRank{"ncclCommInitRank", kNcclSoname};
  NextSymbol<decltype(&::ncclCommInitRankConfig)> commInitRankConfig{"ncclCommInitRankConfig", kNcclSoname};
  NextSymbol<decltype(&::ncclCommInitAll)> commInitAll{"ncclCommInitAll", kNcclSoname};
  NextSymbol<decltype(&::ncclCommSplit)> commSplit{"ncclCommSplit", kNcclSoname};
  NextSymbol<decltype(&::ncclCommDestroy)> commDestroy{"ncclCommDestroy", kNcclSoname};
  NextSymbol<decltype(&::ncclCommAbort)> commAbort{"ncclCommAbort", kNcclSoname};
  NextSymbol<decltype(&::ncclCommGetAsyncError)> commGetAsyncError{"ncclCommGetAsyncError", kNcclSoname};
  NextSymbol<decltype(&::ncclGetErrorString)> getErrorString{"ncclGetErrorString", kNcclSoname};
  NextSymbol<decltype(&::ncclCommUserRank)> commUserRank{"ncclCommUserRank", kNcclSoname};
};

inline RealCuda real_cuda;
inline RealNccl real_nccl;

}  // namespace jitckpt
