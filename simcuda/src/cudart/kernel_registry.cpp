#include "kernel_registry.h"

namespace simcuda {

void KernelRegistry::register_function(const void* host_fun, const char* mangled_name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = by_host_fun_[host_fun];
  if (!slot) {
    slot = std::make_unique<KernelEntry>();
    by_handle_[slot.get()] = slot.get();
  }
  slot->mangled_name = mangled_name ? mangled_name : "";
  slot->host_fun = host_fun;
}

void KernelRegistry::register_variable(const void* host_var, void* device_address, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  variables_[host_var] = DeviceVariable{device_address, size};
}

const KernelEntry* KernelRegistry::find_by_host_fun(const void* host_fun) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_host_fun_.find(host_fun);
  return it == by_host_fun_.end() ? nullptr : it->second.get();
}

const KernelEntry* KernelRegistry::find_by_handle(cudaKernel_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = by_handle_.find(reinterpret_cast<const void*>(handle));
  return it == by_handle_.end() ? nullptr : it->second;
}

std::optional<DeviceVariable> KernelRegistry::find_variable(const void* host_var) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = variables_.find(host_var);
  if (it == variables_.end()) return std::nullopt;
  return it->second;
}

}  // namespace simcuda
