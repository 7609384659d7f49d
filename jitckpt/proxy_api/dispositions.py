"""The one list of what proxy mode does with each CUDA runtime and NCCL entry point.

A declared function that is in none of these tables and whose parameters are all values,
handles or plain results (:attr:`~jitckpt.proxy_api.inventory.Function.generic`) is forwarded
synchronously by the generated layer, its handles translated through the virtual-handle table.
Anything else is refused with the reason below, or, when unlisted, with "needs a hand-written
handler". A refused call fails with an error naming the symbol; it never misbehaves silently.
A refused function that returns a value rather than a status (``ncclTeamWorld`` returns an
``ncclTeam_t``, ``ncclLLA2ACalcSlots`` an ``int``) has no error to return: it logs the same message
and aborts the process, because a made-up value would be used silently.

Symbols the real libraries export that no header read by the inventory declares (deprecated and
graphics-interop runtime functions, internal ABI, ...) are not listed here: libjit.so exports a
trampoline for each that refuses it in proxy mode (:mod:`.trampolines`).
"""
from __future__ import annotations

# Stream-ordered and forwarded by the generated layer: enqueued in the ring, no reply; an error
# surfaces with the next reply, as an asynchronous error does on a GPU. Their ``void*`` parameters
# are device (or pinned) addresses, passed as numbers and checked by the proxy.
ASYNC: dict[str, str] = {
    **{n: "stream-ordered set of device memory" for n in ("cudaMemsetAsync",)},
    **{n: "stream-ordered event/stream order" for n in ("cudaEventRecord", "cudaEventRecordWithFlags",
                                                        "cudaStreamWaitEvent")},
    **{n: "NCCL collective or point-to-point, enqueued on its stream"
       for n in ("ncclAllReduce", "ncclBroadcast", "ncclBcast", "ncclReduce", "ncclAllGather", "ncclReduceScatter",
                 "ncclSend", "ncclRecv", "ncclAlltoAll", "ncclGather", "ncclScatter", "ncclGroupStart",
                 "ncclGroupEnd")},
}

# Hand-written in libjit.so (interposer/src/proxy_calls.cc, ``proxy_call::NAME``) and, where the
# proxy does more than a generic call, in proxy_server/src/call_dispatcher.cc. The nvcc
# registration ABI (``__cudaRegisterFunction``, ``__cudaPushCallConfiguration``, ``__cudaGetKernel``,
# ``__cudaLaunchKernel``, ...) is not declared in the headers and is hand-written too
# (interposer/src/kernel_registration.cc).
SPECIAL: dict[str, str] = {
    **{n: "device memory from the proxy's fixed arena (same pointers after a restart)"
       for n in ("cudaMalloc", "cudaFree")},
    "cudaPointerGetAttributes": "answered from the client's table of device and pinned allocations",
    **{n: "pinned host memory: shared memory mapped at the same address in both processes"
       for n in ("cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaHostGetDevicePointer")},
    **{n: "registered host memory: its pages move into shared memory, mapped at the same address in the proxy"
       for n in ("cudaHostRegister", "cudaHostUnregister")},
    **{n: "synchronous copy/set: pageable bytes travel in the ring (in chunks), device and pinned memory "
          "by address" for n in ("cudaMemcpy", "cudaMemset")},
    "cudaMemcpyAsync": ("stream-ordered copy: device and pinned memory by address and no reply; a pageable "
                        "source travels in the ring; a pageable destination waits, as on a GPU"),
    **{n: "stream-ordered launch by kernel name, no reply; parameter layout asked once per kernel "
          "(cudaFuncGetParamInfo in the proxy)" for n in ("cudaLaunchKernel", "cudaLaunchKernelExC")},
    **{n: "kernel attributes: the kernel named by its registration with the proxy" for n in (
        "cudaFuncGetAttributes", "cudaFuncSetAttribute", "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
        "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", "cudaKernelSetAttributeForDevice")},
}

# Generic calls that are device work without being stream-ordered (ASYNC): a minibatch's replay
# makes them again, like its launches and collectives.
DEVICE_WORK: dict[str, str] = {
    "cudaMemcpy2DArrayToArray": "a copy between CUDA arrays",
    **{n: "NCCL one-sided signals" for n in ("ncclSignal", "ncclWaitSignal")},
}

# Answered in the client without a round trip.
CLIENT: dict[str, str] = {
    **{n: "a string table (the library's own, which holds no device state)"
       for n in ("cudaGetErrorName", "cudaGetErrorString", "ncclGetErrorString")},
    **{n: "per-thread last error, kept in the client (with the asynchronous errors the proxy reported)"
       for n in ("cudaGetLastError", "cudaPeekAtLastError", "ncclGetLastError")},
    **{n: "version numbers" for n in ("cudaRuntimeGetVersion", "ncclGetVersion")},
    "cudaCreateChannelDesc": "a pure function of its arguments",
    "cudaStreamIsCapturing": ("no stream is capturing: stream capture is refused in proxy mode "
                              "(cudaStreamBeginCapture), so the answer is cudaStreamCaptureStatusNone"),
    "ncclParamDumpAll": "prints NCCL's parameters (environment), no device state",
}

_NOT_YET = "not forwarded yet: "
# Refused: the call fails with this reason.
REFUSED: dict[str, str] = {
    "cudaMallocManaged": "unified memory cannot be split between the application and the proxy",
    **{n: "CUDA IPC hands device memory to another process; the proxy owns it"
       for n in ("cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaIpcGetEventHandle",
                 "cudaIpcOpenEventHandle")},
    **{n: _NOT_YET + "CUDA graphs and stream capture" for n in (
        "cudaStreamBeginCapture", "cudaStreamBeginCaptureToGraph", "cudaStreamEndCapture", "cudaStreamGetCaptureInfo", "cudaStreamUpdateCaptureDependencies", "cudaThreadExchangeStreamCaptureMode",
        "cudaGraphAddNode", "cudaGraphConditionalHandleCreate", "cudaGraphDestroy", "cudaGraphExecDestroy",
        "cudaGraphGetNodes", "cudaGraphInstantiateWithFlags", "cudaGraphLaunch", "cudaGraphNodeGetDependencies",
        "cudaGraphRetainUserObject", "cudaUserObjectCreate", "cudaUserObjectRelease")},
    "cudaLaunchCooperativeKernel": _NOT_YET + "cooperative launches",
    "cudaDeviceReset": "would destroy the proxy's state under the replay log",
    **{n: _NOT_YET + "stream-ordered allocation" for n in ("cudaMallocAsync", "cudaFreeAsync")},
    **{n: _NOT_YET + "NCCL-allocated memory" for n in ("ncclMemAlloc", "ncclMemFree")},
    **{n: _NOT_YET + "copies that are not 1-D, or between devices" for n in ("cudaMemcpy2DAsync",
                                                                           "cudaMemcpyPeerAsync")},
    **{n: _NOT_YET + "__device__ variables and CUDA libraries (modules)" for n in (
        "cudaMemcpyToSymbol", "cudaGetSymbolAddress", "cudaLibraryLoadData", "cudaLibraryGetKernel",
        "cudaLibraryUnload")},
    **{n: _NOT_YET + "host callbacks (to run in the client when the proxy's stream reaches them)"
       for n in ("cudaLaunchHostFunc", "cudaStreamAddCallback")},
    "cudaGetDriverEntryPointByVersion": _NOT_YET + "driver entry points (torch's VMM calls)",
    "cudaDeviceGetPCIBusId": _NOT_YET + "a string result into a caller buffer",
    # An array and its count: the generic rule (a non-const T* is one in/out value) would forward
    # the first element only.
    "ncclCommShrink": _NOT_YET + "the exclude list is an array of excludeRanksCount ranks",
    "ncclCommInitRankScalable": _NOT_YET + "commIds is an array of nId unique ids",
    **{n: _NOT_YET + "an array of graph nodes (or edges) and its count" for n in (
        "cudaGraphGetEdges", "cudaGraphGetRootNodes", "cudaGraphNodeGetDependentNodes")},
    **{n: _NOT_YET + "an array of graphics resources and its count" for n in (
        "cudaGraphicsMapResources", "cudaGraphicsUnmapResources")},
    "cudaLibraryEnumerateKernels": _NOT_YET + "an array of kernels and its count",
    **{n: _NOT_YET + "memory registration with a communicator" for n in ("ncclCommRegister",
                                                                         "ncclCommDeregister")},
    **{n: _NOT_YET + "memory-pool attribute values of several types" for n in (
        "cudaMemPoolGetAttribute", "cudaMemPoolSetAttribute", "cudaDeviceGetGraphMemAttribute",
        "cudaDeviceSetGraphMemAttribute", "cudaMemPoolSetAccess")},
    "ncclRedOpCreatePreMulSum": _NOT_YET + "the scalar is passed by pointer (host or device memory)",
    # nccl_device.h: the host side of NCCL's device API, for kernels that communicate by themselves
    # through symmetric memory. Their device state (windows, device communicators) would live in the
    # proxy and their kernels run there, so nothing of it is forwarded yet.
    **{n: _NOT_YET + "NCCL device API (device communicators for kernels that communicate themselves)"
       for n in ("ncclDevCommCreate", "ncclDevCommDestroy", "ncclCommQueryProperties")},
    **{n: _NOT_YET + "NCCL device API (device pointers into symmetric memory windows)"
       for n in ("ncclGetLsaDevicePointer", "ncclGetLsaMultimemDevicePointer", "ncclGetMultimemDevicePointer",
                 "ncclGetPeerDevicePointer")},
    **{n: _NOT_YET + "NCCL device API (resources of device-side barriers and all-to-all)"
       for n in ("ncclGinBarrierCreateRequirement", "ncclLsaBarrierCreateRequirement", "ncclLLA2ACreateRequirement",
                 "ncclLLA2ACalcSlots")},
    **{n: _NOT_YET + "NCCL device API (teams of ranks of a device communicator)"
       for n in ("ncclTeamWorld", "ncclTeamLsa", "ncclTeamRail", "ncclTeamRankToWorld", "ncclTeamRankToLsa")},
}

# Struct types with C-string members: copied as they are into the proxy, those would be this
# process's addresses there. A generically forwarded function taking one sends it field by field
# (its bytes with those members cleared, then each string) and gets nothing back in it (NCCL reads
# a config, never writes it). Each entry: the string members, and the member holding the size of
# the struct the caller's header declared (the bytes that are read of it).
STRING_MEMBERS: dict[str, tuple[tuple[str, ...], str]] = {
    "ncclConfig_t": (("netName", "commName"), "size"),
}

# Struct types with pointer or handle members the generic rule cannot translate (host addresses of
# this process, device memory the proxy's arena did not hand out, handles that are not virtual): a
# function taking one is refused with this reason, naming the type.
POINTER_STRUCTS: dict[str, str] = {
    **{t: "its device pointer is memory the proxy's arena did not hand out" for t in (
        "struct cudaPitchedPtr", "struct cudaMemcpy3DBatchOp", "struct cudaMemsetParams",
        "struct cudaMemAllocNodeParams", "struct cudaMemcpy3DParms")},
    **{t: "its host function and argument pointers are this process's" for t in (
        "struct cudaKernelNodeParams", "struct cudaHostNodeParams", "struct cudaGraphNodeParams")},
    **{t: "its graph-node handles are not translated" for t in (
        "cudaGraphInstantiateParams", "cudaGraphExecUpdateResultInfo")},
    **{t: "its semaphore handles and parameter arrays are not translated" for t in (
        "struct cudaExternalSemaphoreSignalNodeParams", "struct cudaExternalSemaphoreWaitNodeParams")},
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
