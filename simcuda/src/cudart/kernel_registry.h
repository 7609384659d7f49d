// Kernels and __device__ variables registered by nvcc-generated host code (__cudaRegister*).
#pragma once

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "host_kernel_library.h"

namespace simcuda {

struct KernelEntry {
  std::string mangled_name;
  const void* host_fun = nullptr;
};

struct DeviceVariable {
  void* device_address = nullptr;
  size_t size = 0;
};

class KernelRegistry {
 public:
  void register_function(const void* host_fun, const char* mangled_name);
  void register_variable(const void* host_var, void* device_address, size_t size);
  // Lookup by the host stub address (cudaLaunchKernel's `func`) or by a cudaKernel_t handle.
  const KernelEntry* find_by_host_fun(const void* host_fun) const;
  const KernelEntry* find_by_handle(cudaKernel_t handle) const;
  std::optional<DeviceVariable> find_variable(const void* host_var) const;
  // The host implementation, or nullptr if SIMCUDA_KERNEL_LIB provides none.
  const simcuda_host_kernel* implementation(const KernelEntry& k) { return library_.find(k.mangled_name); }

 private:
  mutable std::mutex mu_;
  std::map<const void*, std::unique_ptr<KernelEntry>> by_host_fun_;
  std::map<const void*, const KernelEntry*> by_handle_;  // cudaKernel_t is the entry's address
  std::map<const void*, DeviceVariable> variables_;
  HostKernelLibrary library_;
};

}  // namespace simcuda
