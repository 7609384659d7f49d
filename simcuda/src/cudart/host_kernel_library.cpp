#include "host_kernel_library.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace simcuda {

const simcuda_host_kernel* HostKernelLibrary::find(const std::string& mangled_name) {
  load_once();
  auto it = by_name_.find(mangled_name);
  return it == by_name_.end() ? nullptr : it->second;
}

void HostKernelLibrary::load_once() {
  std::call_once(loaded_, [this] {
    const char* env = std::getenv("SIMCUDA_KERNEL_LIB");
    if (!env || !*env) return;
    std::stringstream paths(env);
    std::string path;
    while (std::getline(paths, path, ':'))
      if (!path.empty()) load(path);
  });
}

void HostKernelLibrary::load(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    std::fprintf(stderr,
                 "simcuda: cannot load kernel library '%s' from SIMCUDA_KERNEL_LIB: %s; "
                 "fix the path or build the library (see simcuda/README.md)\n",
                 path.c_str(), dlerror());
    return;
  }
  using TableFn = const simcuda_host_kernel* (*)(size_t*);
  auto table_fn = reinterpret_cast<TableFn>(dlsym(handle, "simcuda_host_kernels"));
  if (!table_fn) {
    std::fprintf(stderr,
                 "simcuda: kernel library '%s' does not export simcuda_host_kernels; compile it with "
                 "-include simcuda/host_kernel.h and list kernels with SIMCUDA_EXPORT_KERNEL\n",
                 path.c_str());
    return;
  }
  size_t count = 0;
  const simcuda_host_kernel* table = table_fn(&count);
  for (size_t i = 0; i < count; ++i) {
    const simcuda_host_kernel& k = table[i];
    if (k.abi_version != SIMCUDA_HOST_KERNEL_ABI) {
      std::fprintf(stderr, "simcuda: kernel library '%s' has ABI %u, expected %u; rebuild it\n", path.c_str(),
                   k.abi_version, SIMCUDA_HOST_KERNEL_ABI);
      continue;
    }
    Dl_info info{};
    if (!dladdr(k.host_fn, &info) || !info.dli_sname) {
      std::fprintf(stderr,
                   "simcuda: kernel #%zu in '%s' has no dynamic symbol name; kernels must not be static "
                   "or hidden\n",
                   i, path.c_str());
      continue;
    }
    by_name_[info.dli_sname] = &k;
  }
}

}  // namespace simcuda
