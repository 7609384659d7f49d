// Interposed NCCL entry points: learn communicators and collective streams, track each collective
// until its sentinel event completes (collective_tracker.h), report synchronous NCCL errors.
#include <nccl.h>

#include <cstdio>

#include "blocking_call.h"
#include "real_api.h"
#include "registry.h"

using jitckpt::BlockingCallScope;
using jitckpt::LogContext;
using jitckpt::NextSymbol;
using jitckpt::real_nccl;
using jitckpt::Registry;

namespace {

bool call_succeeded(ncclResult_t rc) { return rc == ncclSuccess || rc == ncclInProgress; }

// A collective failed synchronously: report it before the error reaches the application.
void report_sync_error(Registry& r, const char* op, ncclResult_t rc) {
  auto str = real_nccl.getErrorString.get();
  char detail[200];
  std::snprintf(detail, sizeof detail, "%s returned %d (%s)", op, static_cast<int>(rc), str ? str(rc) : "?");
  r.report_failure_and_hold("nccl_error", detail);
}

template <typename Fn, typename... Args>
ncclResult_t forward_collective(const char* op, NextSymbol<Fn>& next, ncclComm_t comm, cudaStream_t stream,
                                Args... args) {
  Fn fn = next.get();
  if (fn == nullptr) return ncclSystemError;
  BlockingCallScope blocking;  // NCCL host calls can block (connection setup, full queues)
  Registry& r = Registry::instance();
  if (!r.tracking()) return fn(args...);
  r.graph().note_collective_stream(stream);
  r.watchdog().ensure_started();
  uint64_t seq = r.collectives().begin_call(op, comm, stream, r.step(), r.phase());
  ncclResult_t rc = fn(args...);
  r.collectives().end_call(seq, call_succeeded(rc));
  if (!call_succeeded(rc)) report_sync_error(r, op, rc);
  return rc;
}

template <typename Fn, typename... Args>
ncclResult_t forward_comm_init(NextSymbol<Fn>& next, ncclComm_t* comm, Args... args) {
  Fn fn = next.get();
  if (fn == nullptr) return ncclSystemError;
  BlockingCallScope blocking;  // rendezvous with the peers
  ncclResult_t rc = fn(comm, args...);
  Registry& r = Registry::instance();
  if (call_succeeded(rc) && comm != nullptr && r.tracking()) r.collectives().add_comm(*comm);
  return rc;
}

}  // namespace

// Exported (the library is built with -fvisibility=hidden).
#pragma GCC visibility push(default)
extern "C" {

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclAllReduce", real_nccl.allReduce, comm, stream, sendbuff, recvbuff, count,
                            datatype, op, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclBroadcast", real_nccl.broadcast, comm, stream, sendbuff, recvbuff, count,
                            datatype, root, comm, stream);
}

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                       cudaStream_t stream) {
  return forward_collective("ncclBcast", real_nccl.bcast, comm, stream, buff, count, datatype, root, comm,
                            stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclReduce", real_nccl.reduce, comm, stream, sendbuff, recvbuff, count, datatype,
                            op, root, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclAllGather", real_nccl.allGather, comm, stream, sendbuff, recvbuff, sendcount,
                            datatype, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return forward_collective("ncclReduceScatter", real_nccl.reduceScatter, comm, stream, sendbuff, recvbuff,
                            recvcount, datatype, op, comm, stream);
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclAlltoAll", real_nccl.alltoAll, comm, stream, sendbuff, recvbuff, count,
                            datatype, comm, stream);
}

ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                        ncclComm_t comm, cudaStream_t stream) {
  return forward_collective("ncclGather", real_nccl.gather, comm, stream, sendbuff, recvbuff, count, datatype,
                            root, comm, stream);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  Registry& r = Registry::instance();
  if (r.tracking() && (r.send_log().enabled() || r.recv_replay().enabled())) {  // off: no context read
    LogContext::Value ctx = r.log_context().get();
    if (r.send_log().enabled()) r.send_log().on_send(ctx, sendbuff, count, datatype, peer, comm, stream);
    if (r.recv_replay().replaying(ctx)) {  // the survivors got this message before the failure
      r.recv_replay().dropped_send();
      return ncclSuccess;
    }
    r.recv_replay().went_live(ctx);
  }
  return forward_collective("ncclSend", real_nccl.send, comm, stream, sendbuff, count, datatype, peer, comm,
                            stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  Registry& r = Registry::instance();
  if (r.tracking() && r.recv_replay().enabled()) {
    LogContext::Value ctx = r.log_context().get();
    if (r.recv_replay().replaying(ctx)) {
      ncclResult_t rc = r.recv_replay().serve(ctx, recvbuff, count, datatype, peer, comm, stream);
      if (rc != ncclSuccess) report_sync_error(r, "ncclRecv (replay from the logs)", rc);
      return rc;
    }
    r.recv_replay().went_live(ctx);
  }
  return forward_collective("ncclRecv", real_nccl.recv, comm, stream, recvbuff, count, datatype, peer, comm,
                            stream);
}

ncclResult_t ncclGroupStart() {
  auto fn = real_nccl.groupStart.get();
  if (fn == nullptr) return ncclSystemError;
  ncclResult_t rc = fn();
  Registry& r = Registry::instance();
  if (call_succeeded(rc) && r.tracking()) r.collectives().group_start();
  return rc;
}

ncclResult_t ncclGroupEnd() {
  auto fn = real_nccl.groupEnd.get();
  if (fn == nullptr) return ncclSystemError;
  ncclResult_t rc;
  {
    BlockingCallScope blocking;
    rc = fn();
  }
  Registry& r = Registry::instance();
  if (!r.tracking()) return rc;
  r.collectives().group_end(call_succeeded(rc));
  if (!call_succeeded(rc)) report_sync_error(r, "ncclGroupEnd", rc);
  return rc;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank) {
  return forward_comm_init(real_nccl.commInitRank, comm, nranks, comm_id, rank);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank,
                                    ncclConfig_t* config) {
  return forward_comm_init(real_nccl.commInitRankConfig, comm, nranks, comm_id, rank, config);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  auto fn = real_nccl.commInitAll.get();
  if (fn == nullptr) return ncclSystemError;
  ncclResult_t rc = fn(comms, ndev, devlist);
  Registry& r = Registry::instance();
  if (call_succeeded(rc) && r.tracking())
    for (int i = 0; i < ndev; ++i) r.collectives().add_comm(comms[i]);
  return rc;
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  auto fn = real_nccl.commSplit.get();
  if (fn == nullptr) return ncclSystemError;
  ncclResult_t rc = fn(comm, color, key, newcomm, config);
  Registry& r = Registry::instance();
  if (call_succeeded(rc) && newcomm != nullptr && *newcomm != nullptr && r.tracking())
    r.collectives().add_comm(*newcomm);
  return rc;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Registry& r = Registry::instance();
  if (r.tracking()) r.collectives().remove_comm(comm);  // before the comm is freed
  auto fn = real_nccl.commDestroy.get();
  return fn ? fn(comm) : ncclSystemError;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Registry& r = Registry::instance();
  if (r.tracking()) r.collectives().remove_comm(comm);
  auto fn = real_nccl.commAbort.get();
  return fn ? fn(comm) : ncclSystemError;
}

}  // extern "C"
#pragma GCC visibility pop
