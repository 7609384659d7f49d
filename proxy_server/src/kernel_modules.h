// The proxy's kernels: the client's fat binaries (modules), registered with the real runtime the
// way nvcc's generated code registers them at load time (__cudaRegisterFatBinary on the image, a
// __cudaRegisterFunction per kernel under a stand-in host stub of the proxy's own,
// __cudaRegisterFatBinaryEnd), and each kernel's parameter layout, asked for when the client first
// uses the kernel. On a GPU the runtime loads the image; simcuda runs kernels from its host kernel
// library by name and only checks the image's header.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "call_protocol.h"

namespace jitckpt::proxy {

class KernelModules {
 public:
  struct Kernel {
    std::string name;                // stable: kernels are never moved or erased
    std::unique_ptr<char> stand_in;  // the "host stub" this kernel is registered under here
    std::vector<KernelParam> params;
    uint32_t param_bytes = 0;
    bool known = false;  // its layout was read (the runtime has code for it)
  };

  KernelModules() = default;
  ~KernelModules();
  KernelModules(const KernelModules&) = delete;
  KernelModules& operator=(const KernelModules&) = delete;

  // Registers the module in `fd` (see RegisterModule); its id, or -1 and `error`. Takes `fd`.
  int64_t add_module(int fd, const RegisterModule& m, std::string* error);
  // Kernel `ref` with its parameter layout (read once); nullptr with the error if the runtime has
  // no code for it or `ref` names no kernel.
  const Kernel* resolve(KernelRef ref, uint32_t* id, std::string* error, int* status);
  // A resolved kernel, or nullptr; a resolved kernel never changes.
  const Kernel* kernel(uint32_t id);

 private:
  struct Module {
    void* map = nullptr;  // the memfd, mapped read-only: the runtime may read the image lazily
    size_t map_size = 0;
    FatbinWrapper wrapper{};
    void** handle = nullptr;
    std::vector<uint32_t> kernels;  // ids, in registration order
  };

  std::mutex mu_;
  std::deque<Module> modules_;
  std::deque<Kernel> kernels_;
};

}  // namespace jitckpt::proxy
