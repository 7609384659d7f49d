// The NCCL C API (extern "C") on top of Communicator, GroupQueue and the simcuda stream runtime.
#include <cuda_runtime_api.h>
#include <nccl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "communicator.h"
#include "fault_plan.h"
#include "group_queue.h"
#include "reduction.h"
#include "rendezvous.h"
#include "stream_submit.h"

#define SIMCUDA_NCCL_API extern "C" __attribute__((visibility("default")))

extern "C" void simcudaSetStickyError(cudaError_t error);

// The opaque handle behind ncclComm_t.
struct ncclComm {
  std::shared_ptr<simcuda::nccl::Communicator> impl;
};

using simcuda::nccl::Collective;
using simcuda::nccl::Communicator;
using simcuda::nccl::FaultMode;
using simcuda::nccl::FaultPlan;
using simcuda::nccl::GroupQueue;
using simcuda::nccl::PendingCall;

namespace {
thread_local std::string t_last_error;

ncclResult_t fail(ncclResult_t r, const std::string& why) {
  t_last_error = why;
  return r;
}

// A config's strings, as NCCL_DEBUG=INFO reports them (simcuda's NCCL has no network and no
// names to use them for): what shows that they reached the process that made the communicator.
void report_config(const char* call, const ncclConfig_t* config) {
  const char* level = std::getenv("NCCL_DEBUG");
  if (config == nullptr || level == nullptr || std::strcmp(level, "INFO") != 0) return;
  auto text = [config](size_t at) -> const char* {
    const char* s = nullptr;
    if (at + sizeof s <= config->size) std::memcpy(&s, reinterpret_cast<const char*>(config) + at, sizeof s);
    return s != nullptr ? s : "(unset)";
  };
  std::fprintf(stderr, "NCCL INFO %s: commName %s netName %s\n", call, text(offsetof(ncclConfig_t, commName)),
               text(offsetof(ncclConfig_t, netName)));
}

// `device` < 0: the calling thread's current device.
ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, bool blocking,
                       int device = -1) {
  if (!out) return fail(ncclInvalidArgument, "comm out-pointer is NULL");
  if (!FaultPlan::get().config_error().empty()) return fail(ncclInvalidArgument, FaultPlan::get().config_error());
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return fail(ncclInvalidArgument, "rank " + std::to_string(rank) + " out of range for nranks " +
                                         std::to_string(nranks));
  auto rid = simcuda::nccl::RendezvousId::decode(id);
  if (!rid) return fail(ncclInvalidArgument, "ncclUniqueId was not produced by simcuda's ncclGetUniqueId");
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return fail(ncclUnhandledCudaError, "cudaGetDevice failed");
  std::shared_ptr<Communicator> comm;
  try {
    comm = std::make_shared<Communicator>(nranks, rank, device, *rid);
  } catch (const std::exception& e) {
    return fail(ncclSystemError, e.what());
  }
  *out = new ncclComm{comm};
  if (!blocking) {
    comm->init_started();
    std::thread([comm] { comm->initialize(); }).detach();
    return ncclInProgress;
  }
  ncclResult_t r = comm->initialize();
  if (r != ncclSuccess) {
    delete *out;
    *out = nullptr;
    return fail(r, "bootstrap failed: could not reach the root or a peer on 127.0.0.1");
  }
  return ncclSuccess;
}

ncclResult_t validate(ncclComm_t comm, const Collective& c) {
  if (!comm || !comm->impl) return fail(ncclInvalidArgument, "comm is NULL");
  if (simcuda::nccl::type_size(c.type) == 0) return fail(ncclInvalidArgument, "unsupported datatype");
  const bool reduces = c.kind == Collective::Kind::AllReduce || c.kind == Collective::Kind::Reduce ||
                       c.kind == Collective::Kind::ReduceScatter;
  if (reduces && (!simcuda::nccl::valid_op(c.op) || c.type == ncclFloat8e4m3 || c.type == ncclFloat8e5m2))
    return fail(ncclInvalidArgument, "unsupported reduction op/datatype (simcuda supports sum/prod/max/min/avg)");
  const bool rooted = c.kind == Collective::Kind::Broadcast || c.kind == Collective::Kind::Reduce ||
                      c.kind == Collective::Kind::Gather || c.is_p2p();
  if (rooted && (c.peer < 0 || c.peer >= comm->impl->nranks())) return fail(ncclInvalidArgument, "root/peer out of range");
  return ncclSuccess;
}

ncclResult_t submit_batch(const std::shared_ptr<Communicator>& comm, cudaStream_t stream, std::vector<Collective> b) {
  return simcuda::nccl::submit_to_stream(comm, stream, [comm, batch = std::move(b)] { comm->execute(batch); });
}

// Applies failure injection, then issues `c` now or queues it in the open group.
ncclResult_t issue(ncclComm_t comm, cudaStream_t stream, Collective c) {
  if (ncclResult_t r = validate(comm, c); r != ncclSuccess) return r;
  auto impl = comm->impl;
  switch (FaultPlan::get().on_call(impl->rank())) {
    case FaultMode::None: break;
    case FaultMode::Crash:  // the process dies when the collective is reached on the stream
      return simcuda::nccl::submit_to_stream(impl, stream, [] {
        std::fprintf(stderr, "simcuda: SIMCUDA_FAIL_MODE=crash: killing pid %d\n", static_cast<int>(getpid()));
        kill(getpid(), SIGKILL);
      });
    case FaultMode::Error:
      impl->set_async_error(ncclSystemError);
      return fail(ncclSystemError, "injected failure (SIMCUDA_FAIL_MODE=error)");
    case FaultMode::Hang:
      return simcuda::nccl::submit_to_stream(impl, stream, [impl] { impl->hang_until_abort(); });
    case FaultMode::Sticky:
      return simcuda::nccl::submit_to_stream(impl, stream, [impl] {
        simcudaSetStickyError(cudaErrorIllegalAddress);
        impl->set_async_error(ncclUnhandledCudaError);
      });
  }
  GroupQueue& group = GroupQueue::current();
  if (group.active()) {
    group.add(PendingCall{impl, stream, c});
    return ncclSuccess;
  }
  return submit_batch(impl, stream, {c});
}
}  // namespace

SIMCUDA_NCCL_API ncclResult_t ncclGetVersion(int* version) {
  if (!version) return fail(ncclInvalidArgument, "version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

SIMCUDA_NCCL_API const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}

SIMCUDA_NCCL_API const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

SIMCUDA_NCCL_API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return fail(ncclInvalidArgument, "uniqueId is NULL");
  try {
    *id = simcuda::nccl::start_bootstrap_root().encode();
  } catch (const std::exception& e) {
    return fail(ncclSystemError, e.what());
  }
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return init_rank(comm, nranks, id, rank, true);
}

SIMCUDA_NCCL_API ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                                     ncclConfig_t* config) {
  bool blocking = true;
  if (config) {
    if (config->magic != NCCL_API_MAGIC)
      return fail(ncclInvalidArgument, "ncclConfig_t not initialized with NCCL_CONFIG_INITIALIZER");
    blocking = config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT also means blocking
    report_config("ncclCommInitRankConfig", config);
  }
  return init_rank(comm, nranks, id, rank, blocking);
}

SIMCUDA_NCCL_API ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  if (!comms || ndev < 1) return fail(ncclInvalidArgument, "comms is NULL or ndev < 1");
  ncclUniqueId id;
  if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) return r;
  std::vector<ncclResult_t> results(static_cast<size_t>(ndev), ncclSuccess);
  std::vector<std::thread> threads;
  for (int i = 0; i < ndev; ++i) {
    threads.emplace_back([&, i] {
      const int dev = devlist ? devlist[i] : i;
      if (cudaSetDevice(dev) != cudaSuccess) {
        results[static_cast<size_t>(i)] = ncclInvalidArgument;
        return;
      }
      results[static_cast<size_t>(i)] = init_rank(&comms[i], ndev, id, i, true);
    });
  }
  for (auto& t : threads) t.join();
  for (ncclResult_t r : results)
    if (r != ncclSuccess) return fail(r, "ncclCommInitAll: a rank failed to initialize");
  return ncclSuccess;
}

// Collective over `comm`: ranks with the same color form a new communicator, ordered by (key, rank).
// The color's lowest new rank starts the new bootstrap root; its id travels over the parent's mesh.
SIMCUDA_NCCL_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                            ncclConfig_t* config) {
  if (!comm || !newcomm) return fail(ncclInvalidArgument, "comm or newcomm is NULL");
  if (color < NCCL_SPLIT_NOCOLOR) return fail(ncclInvalidArgument, "color must be >= 0 or NCCL_SPLIT_NOCOLOR");
  if (config && config->magic != NCCL_API_MAGIC)
    return fail(ncclInvalidArgument, "ncclConfig_t not initialized with NCCL_CONFIG_INITIALIZER");
  const bool blocking = !config || config->blocking != 0;
  report_config("ncclCommSplit", config);
  auto parent = comm->impl;
  struct Member {
    int32_t color, key, rank;
  };
  const auto n = static_cast<size_t>(parent->nranks());
  std::vector<Member> members(n);
  const Member mine{color, key, parent->rank()};
  if (!parent->allgather_host(&mine, members.data(), sizeof(Member)))
    return fail(ncclSystemError, "ncclCommSplit: exchange over the parent communicator failed");
  std::vector<Member> group;
  for (const Member& m : members)
    if (m.color == color && color != NCCL_SPLIT_NOCOLOR) group.push_back(m);
  std::sort(group.begin(), group.end(),
            [](const Member& a, const Member& b) { return a.key != b.key ? a.key < b.key : a.rank < b.rank; });
  int new_rank = -1;
  for (size_t i = 0; i < group.size(); ++i)
    if (group[i].rank == parent->rank()) new_rank = static_cast<int>(i);
  ncclUniqueId my_id{};
  if (new_rank == 0) {
    try {
      my_id = simcuda::nccl::start_bootstrap_root().encode();
    } catch (const std::exception& e) {
      return fail(ncclSystemError, e.what());
    }
  }
  std::vector<ncclUniqueId> ids(n);
  if (!parent->allgather_host(&my_id, ids.data(), sizeof(ncclUniqueId)))
    return fail(ncclSystemError, "ncclCommSplit: exchange over the parent communicator failed");
  if (new_rank < 0) {
    *newcomm = nullptr;  // NCCL_SPLIT_NOCOLOR
    return ncclSuccess;
  }
  const ncclUniqueId& id = ids[static_cast<size_t>(group[0].rank)];
  return init_rank(newcomm, static_cast<int>(group.size()), id, new_rank, blocking, parent->device());
}

SIMCUDA_NCCL_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  if (!comm) return fail(ncclInvalidArgument, "comm is NULL");
  comm->impl->wait_idle();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return fail(ncclInvalidArgument, "comm is NULL");
  delete comm;  // queued stream work keeps the communicator alive until it has run
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  comm->impl->abort();  // unblocks hung collectives; their stream then moves on
  delete comm;
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  if (!comm || !err) return fail(ncclInvalidArgument, "comm or asyncError is NULL");
  *err = comm->impl->async_error();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm || !count) return fail(ncclInvalidArgument, "comm or count is NULL");
  *count = comm->impl->nranks();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!comm || !device) return fail(ncclInvalidArgument, "comm or device is NULL");
  *device = comm->impl->device();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm || !rank) return fail(ncclInvalidArgument, "comm or rank is NULL");
  *rank = comm->impl->rank();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                            ncclComm_t comm, cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::AllReduce, s, r, n, t, op, 0});
}
SIMCUDA_NCCL_API ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t t, int root,
                                            ncclComm_t comm, cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Broadcast, s, r, n, t, ncclSum, root});
}
SIMCUDA_NCCL_API ncclResult_t ncclBcast(void* buf, size_t n, ncclDataType_t t, int root, ncclComm_t comm,
                                        cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Broadcast, buf, buf, n, t, ncclSum, root});
}
SIMCUDA_NCCL_API ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, int root,
                                         ncclComm_t comm, cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Reduce, s, r, n, t, op, root});
}
SIMCUDA_NCCL_API ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t comm,
                                            cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::AllGather, s, r, n, t, ncclSum, 0});
}
SIMCUDA_NCCL_API ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op,
                                                ncclComm_t comm, cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::ReduceScatter, s, r, n, t, op, 0});
}
SIMCUDA_NCCL_API ncclResult_t ncclAlltoAll(const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t comm,
                                           cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::AllToAll, s, r, n, t, ncclSum, 0});
}
SIMCUDA_NCCL_API ncclResult_t ncclGather(const void* s, void* r, size_t n, ncclDataType_t t, int root,
                                         ncclComm_t comm, cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Gather, s, r, n, t, ncclSum, root});
}
SIMCUDA_NCCL_API ncclResult_t ncclSend(const void* s, size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                                       cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Send, s, nullptr, n, t, ncclSum, peer});
}
SIMCUDA_NCCL_API ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t t, int peer, ncclComm_t comm,
                                       cudaStream_t st) {
  return issue(comm, st, {Collective::Kind::Recv, nullptr, r, n, t, ncclSum, peer});
}

SIMCUDA_NCCL_API ncclResult_t ncclGroupStart() {
  GroupQueue::current().start();
  return ncclSuccess;
}

SIMCUDA_NCCL_API ncclResult_t ncclGroupEnd() {
  GroupQueue& group = GroupQueue::current();
  if (!group.active()) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  std::vector<PendingCall> calls = group.end();
  // Point-to-point calls of one (communicator, stream) run as one batch so matching sends and
  // receives progress together; collectives keep their order, one stream op each.
  struct Batch {
    std::shared_ptr<Communicator> comm;
    cudaStream_t stream;
    std::vector<Collective> calls;
  };
  std::vector<Batch> batches;
  std::map<std::pair<Communicator*, cudaStream_t>, size_t> p2p_batch;
  for (PendingCall& pc : calls) {
    if (pc.call.is_p2p()) {
      auto key = std::make_pair(pc.comm.get(), pc.stream);
      auto it = p2p_batch.find(key);
      if (it == p2p_batch.end()) {
        p2p_batch[key] = batches.size();
        batches.push_back(Batch{pc.comm, pc.stream, {pc.call}});
      } else {
        batches[it->second].calls.push_back(pc.call);
      }
    } else {
      batches.push_back(Batch{pc.comm, pc.stream, {pc.call}});
    }
  }
  ncclResult_t result = ncclSuccess;
  for (Batch& b : batches)
    if (ncclResult_t r = submit_batch(b.comm, b.stream, std::move(b.calls)); r != ncclSuccess) result = r;
  return result;
}

SIMCUDA_NCCL_API ncclResult_t ncclMemAlloc(void** ptr, size_t size) {
  return cudaMalloc(ptr, size) == cudaSuccess ? ncclSuccess : fail(ncclUnhandledCudaError, "cudaMalloc failed");
}
SIMCUDA_NCCL_API ncclResult_t ncclMemFree(void* ptr) {
  return cudaFree(ptr) == cudaSuccess ? ncclSuccess : fail(ncclUnhandledCudaError, "cudaFree failed");
}

// Buffer registration is an optimization hint; simcuda accepts it and does nothing.
SIMCUDA_NCCL_API ncclResult_t ncclCommRegister(const ncclComm_t comm, void* buff, size_t, void** handle) {
  if (!comm || !handle) return fail(ncclInvalidArgument, "comm or handle is NULL");
  *handle = buff;
  return ncclSuccess;
}
SIMCUDA_NCCL_API ncclResult_t ncclCommDeregister(const ncclComm_t comm, void*) {
  return comm ? ncclSuccess : fail(ncclInvalidArgument, "comm is NULL");
}
