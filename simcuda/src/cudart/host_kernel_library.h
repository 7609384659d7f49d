// The kernel libraries named by SIMCUDA_KERNEL_LIB, indexed by mangled kernel name.
#pragma once

#include <map>
#include <mutex>
#include <string>

#include "simcuda/host_kernel_abi.h"

namespace simcuda {

class HostKernelLibrary {
 public:
  // nullptr if no loaded library implements `mangled_name`. Loads the libraries on first use.
  const simcuda_host_kernel* find(const std::string& mangled_name);

 private:
  void load_once();
  void load(const std::string& path);

  std::once_flag loaded_;
  std::map<std::string, const simcuda_host_kernel*> by_name_;
};

}  // namespace simcuda
