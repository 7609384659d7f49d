// The proxy's side of a call: validates the request, runs it on the real CUDA runtime and NCCL, and
// says what to reply. Device pointers are checked against the allocations this proxy handed out
// and the pinned memory the client shares; handles are the virtual handles this proxy minted. A
// stale or hostile argument is an error with a message, never a wild access.
#pragma once

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <vector>

#include "address_book.h"
#include "call_protocol.h"
#include "fd_mailbox.h"
#include "fixed_arena.h"
#include "generic_call.h"
#include "handle_table.h"
#include "kernel_modules.h"

namespace jitckpt::proxy {

// What every channel of one proxy shares: the objects it created and the memory it knows.
class DeviceState {
 public:
  DeviceState() = default;
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  HandleTable handles;
  AddressBook memory;
  FixedArena arena;  // device memory at the same addresses in every proxy
  FdMailbox mailbox;  // memfds of shared host memory and modules, from the socket's listener
  KernelModules kernels;
  // Communicator queries (ncclCommGetAsyncError, ...) hold it shared, ncclCommDestroy/Abort/Finalize
  // exclusively. The client orders them already (libjit.so's watchdog polls a communicator only
  // while it is registered), but through another process, which this one's threads cannot see: a
  // client that did race them would free a communicator under a query here.
  std::shared_mutex comm_lifetime;

  // While the client asks for it (kFence: it can recover transparently from saved buffers): after an NCCL
  // call fails for a reason a new proxy may get past (system, internal, remote, CUDA error), the
  // proxy runs no more device work, so its buffers stay as they were at the failed call (the
  // optimizer step the program posts after a failed all-reduce must not run on them). Queries,
  // synchronizes, copies to the host and kSaveDevice still run, and every reply carries the failure
  // (ReplyHead::async_*), so whichever thread asks next learns of it.
  std::atomic<bool> fence_on_nccl_failure{false};
  std::atomic<bool> fenced{false};
  std::atomic<int32_t> fence_status{0};
  std::atomic<uint32_t> fence_call{0};
  std::atomic<uint64_t> fence_seq{0};
};

// One channel's side of the calls: each client thread has a channel, served by one proxy thread.
class CallDispatcher {
 public:
  explicit CallDispatcher(DeviceState& state) : state_(state) {}
  CallDispatcher(const CallDispatcher&) = delete;
  CallDispatcher& operator=(const CallDispatcher&) = delete;

  // Runs the request (`call`, `data`, `len` from the ring). Returns false for a kNoReply request
  // (its failure, if any, is reported with the next reply); otherwise fills `reply`.
  bool handle(uint32_t call, const uint8_t* data, size_t len, std::vector<uint8_t>* reply);

 private:
  using Outcome = GenericReply;  // one call's status, message and results
  void run(uint32_t call, const char* name, const uint8_t* args, size_t nargs, Outcome* out);
  void run_special(Call call, const char* name, const uint8_t* args, size_t nargs, Outcome* out);
  void register_module(const uint8_t* args, size_t nargs, Outcome* out);
  void register_kernel(const uint8_t* args, size_t nargs, Outcome* out);
  void launch_kernel(const uint8_t* args, size_t nargs, Outcome* out);
  void kernel_attribute(const uint8_t* args, size_t nargs, Outcome* out);
  void host_alloc(const uint8_t* args, size_t nargs, Outcome* out);
  void host_free(uint64_t addr, Outcome* out);
  void copy_device(bool save, const uint8_t* args, size_t nargs, Outcome* out);
  // Whether `call` may run while the proxy is fenced (see DeviceState::fenced).
  static bool runs_when_fenced(uint32_t call);
  void fence_if_nccl_failed(uint32_t call, const char* name, uint64_t seq, const Outcome& out);

  DeviceState& state_;
  // The first failure of a kNoReply call since the last reply.
  int32_t async_status_ = 0;
  uint32_t async_call_ = 0;
  uint64_t async_seq_ = 0;
};

}  // namespace jitckpt::proxy
