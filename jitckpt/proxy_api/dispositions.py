"""The one list of what proxy mode does with each CUDA runtime and NCCL entry point.

A declared function that is in none of these tables and whose parameters are all values,
handles or plain results (:attr:`~jitckpt.proxy_api.inventory.Function.generic`) is forwarded
synchronously by the generated layer, its handles translated through the virtual-handle table.
Anything else is refused with the reason below, or, when unlisted, with "needs a hand-written
handler". A refused call fails with an error naming the symbol; it never misbehaves silently.
"""
from __future__ import annotations

# Stream-ordered: enqueued in the ring, no reply; an error surfaces at the next synchronizing
# call, as an asynchronous error does on a GPU.
ASYNC: dict[str, str] = {
    **{n: "stream-ordered launch" for n in ("cudaLaunchKernel", "cudaLaunchKernel_ptsz", "__cudaLaunchKernel",
                                            "__cudaLaunchKernel_ptsz", "cudaLaunchKernelExC")},
    **{n: "stream-ordered copy/set (pinned or device memory; pageable bytes travel in the ring)"
       for n in ("cudaMemcpyAsync", "cudaMemcpyAsync_ptsz", "cudaMemsetAsync", "cudaMemsetAsync_ptsz",
                 "cudaMemcpy2DAsync", "cudaMemcpyPeerAsync")},
    **{n: "stream-ordered event/stream order" for n in ("cudaEventRecord", "cudaEventRecord_ptsz",
                                                        "cudaEventRecordWithFlags", "cudaStreamWaitEvent",
                                                        "cudaStreamWaitEvent_ptsz", "cudaFreeAsync")},
    **{n: "NCCL collective or point-to-point, enqueued on its stream"
       for n in ("ncclAllReduce", "ncclBroadcast", "ncclBcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
                 "ncclSend", "ncclRecv", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclGroupStart",
                 "ncclGroupEnd")},
}

# Handled by hand in the client and the proxy.
SPECIAL: dict[str, str] = {
    **{n: "device memory from the proxy's fixed arena (same pointers after a restart)"
       for n in ("cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaMemGetInfo", "cudaPointerGetAttributes",
                 "ncclMemAlloc", "ncclMemFree")},
    **{n: "pinned host memory: shared memory mapped at the same address in both processes"
       for n in ("cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaHostRegister", "cudaHostUnregister",
                 "cudaHostGetDevicePointer")},
    **{n: "synchronous copy/set: pageable bytes travel in the ring or a side buffer"
       for n in ("cudaMemcpy", "cudaMemcpy_ptds", "cudaMemset", "cudaMemcpyToSymbol")},
    **{n: "kernel registration: forwarded once by name, replayable into a new proxy"
       for n in ("__cudaRegisterFatBinary", "__cudaRegisterFatBinaryEnd", "__cudaRegisterFunction",
                 "__cudaRegisterVar", "__cudaUnregisterFatBinary", "__cudaInitModule", "__cudaGetKernel",
                 "cudaGetSymbolAddress", "cudaLibraryLoadData", "cudaLibraryGetKernel", "cudaLibraryUnload")},
    **{n: "launch configuration: a thread-local stack in the client"
       for n in ("__cudaPushCallConfiguration", "__cudaPopCallConfiguration")},
    **{n: "kernel attributes: the kernel named by its registration"
       for n in ("cudaFuncGetAttributes", "cudaFuncSetAttribute", "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
                 "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", "cudaKernelSetAttributeForDevice")},
    **{n: "host callback: run in the client when the proxy reports the stream reached it"
       for n in ("cudaLaunchHostFunc", "cudaStreamAddCallback")},
    "cudaGetDriverEntryPointByVersion": "driver entry points: proxied stubs handed back (torch's VMM calls)",
    "cudaDeviceGetPCIBusId": "returns a string into a caller buffer",
    "ncclCommInitRankConfig": "communicator config struct (in and out)",
    "ncclCommRegister": "registers device memory with a communicator",
    "ncclCommDeregister": "registers device memory with a communicator",
    **{n: "memory-pool attribute values of several types" for n in ("cudaMemPoolGetAttribute", "cudaMemPoolSetAttribute",
                                                                     "cudaDeviceGetGraphMemAttribute",
                                                                     "cudaDeviceSetGraphMemAttribute")},
    "cudaMemPoolSetAccess": "array of access descriptors",
    "ncclRedOpCreatePreMulSum": "the scalar is passed by pointer (host or device memory)",
}

# Answered in the client without a round trip.
CLIENT: dict[str, str] = {
    **{n: "a string table" for n in ("cudaGetErrorName", "cudaGetErrorString", "ncclGetErrorString")},
    **{n: "per-thread last error, kept in the client (with the asynchronous errors the proxy reported)"
       for n in ("cudaGetLastError", "cudaPeekAtLastError", "ncclGetLastError")},
    **{n: "version numbers" for n in ("cudaRuntimeGetVersion", "ncclGetVersion")},
    **{n: "profiler markers (no-ops outside a profiler)" for n in ("cudaProfilerStart", "cudaProfilerStop")},
}

# Refused: the call fails with this reason.
REFUSED: dict[str, str] = {
    "cudaMallocManaged": "unified memory cannot be split between the application and the proxy",
    **{n: "CUDA IPC hands device memory to another process; the proxy owns it"
       for n in ("cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaIpcGetEventHandle",
                 "cudaIpcOpenEventHandle")},
    **{n: "CUDA graphs and stream capture: not yet forwarded" for n in (
        "cudaStreamBeginCapture", "cudaStreamBeginCaptureToGraph", "cudaStreamEndCapture", "cudaStreamIsCapturing",
        "cudaStreamGetCaptureInfo", "cudaStreamUpdateCaptureDependencies", "cudaThreadExchangeStreamCaptureMode",
        "cudaGraphAddNode", "cudaGraphConditionalHandleCreate", "cudaGraphDestroy", "cudaGraphExecDestroy",
        "cudaGraphGetNodes", "cudaGraphInstantiateWithFlags", "cudaGraphLaunch", "cudaGraphNodeGetDependencies",
        "cudaGraphRetainUserObject", "cudaUserObjectCreate", "cudaUserObjectRelease")},
    "cudaLaunchCooperativeKernel": "cooperative launches: not yet forwarded",
    "cudaDeviceReset": "would destroy the proxy's state under the replay log",
}

# Libraries proxy mode does not forward at their own API. cuBLAS(Lt), cuDNN and NCCL link the CUDA
# runtime statically and reach the driver through cuGetProcAddress, so wrapping libcudart does not
# catch their work: each needs its API forwarded (or the driver API), which is not built.
OTHER_LIBRARIES = ("cuBLAS", "cuBLASLt", "cuDNN", "cuSPARSE", "cuSPARSELt", "cuSOLVER", "cuFFT", "cuFile",
                   "NVRTC", "NVSHMEM", "CUPTI", "driver")


def table_of(name: str) -> tuple[str, str] | None:
    """(class, reason) of a listed symbol, or None."""
    for cls, table in (("async", ASYNC), ("special", SPECIAL), ("client", CLIENT), ("refused", REFUSED)):
        if name in table:
            return cls, table[name]
    return None
