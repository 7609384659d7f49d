// The simulated runtime: the single registry of libcudart (devices, memory, streams, events, kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "device.h"
#include "device_arena.h"
#include "error_state.h"
#include "event.h"
#include "kernel_registry.h"
#include "pinned_host_registry.h"
#include "virtual_memory.h"

namespace simcuda {

class Runtime {
 public:
  // Created on first use and intentionally never destroyed: stream workers may still be running (or
  // hung, as on a GPU) at exit, and must not race with static destructors.
  static Runtime& get();

  ErrorState& errors() { return errors_; }
  DeviceArena& arena() { return *arena_; }
  VirtualMemory& virtual_memory() { return *vmm_; }
  // Device memory containing `ptr`: cudaMalloc's (the arena) or the driver's mapped memory.
  std::optional<DeviceAllocation> find_device(const void* ptr) const;
  // True if [ptr, ptr+len) lies entirely inside one device allocation or mapping.
  bool device_range(const void* ptr, size_t len) const;
  PinnedHostRegistry& pinned() { return pinned_; }
  KernelRegistry& kernels() { return kernels_; }

  int device_count() const { return static_cast<int>(devices_.size()); }
  bool valid_device(int d) const { return d >= 0 && d < device_count(); }
  Device& device(int d) { return *devices_.at(static_cast<size_t>(d)); }
  int current_device() const;
  void set_current_device(int d);
  Device& current() { return device(current_device()); }

  // Stream handles. 0 means the legacy default stream, or the per-thread default stream when
  // `per_thread_default` (the _ptsz/_ptds entry points). Returns nullptr for an unknown handle.
  std::shared_ptr<Stream> resolve_stream(cudaStream_t handle, bool per_thread_default = false);
  cudaStream_t add_stream(std::shared_ptr<Stream> s);
  std::shared_ptr<Stream> remove_stream(cudaStream_t handle);

  cudaEvent_t add_event(std::shared_ptr<Event> e);
  std::shared_ptr<Event> find_event(cudaEvent_t handle);
  std::shared_ptr<Event> remove_event(cudaEvent_t handle);

 private:
  Runtime();
  std::shared_ptr<Stream> per_thread_stream(int device);

  ErrorState errors_;
  std::unique_ptr<DeviceArena> arena_;
  std::unique_ptr<VirtualMemory> vmm_;
  PinnedHostRegistry pinned_;
  KernelRegistry kernels_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::mutex handles_mu_;
  std::map<cudaStream_t, std::shared_ptr<Stream>> streams_;
  std::map<cudaEvent_t, std::shared_ptr<Event>> events_;
};

}  // namespace simcuda
