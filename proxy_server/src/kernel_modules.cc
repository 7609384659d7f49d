#include "kernel_modules.h"

#include <cuda_runtime_api.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

// nvcc's registration ABI (crt/host_runtime.h).
extern "C" void** __cudaRegisterFatBinary(void* fatCubin);
extern "C" void __cudaRegisterFatBinaryEnd(void** handle);
extern "C" void __cudaUnregisterFatBinary(void** handle);
extern "C" void __cudaRegisterFunction(void** handle, const char* hostFun, char* deviceFun, const char* deviceName,
                                       int threadLimit, uint3* tid, uint3* bid, dim3* bDim, dim3* gDim, int* wSize);

namespace jitckpt::proxy {
namespace {

constexpr size_t kMaxKernelName = 4096;

// The names in [p, p + size): exactly `count` NUL-terminated strings of 1 to 4096 bytes.
bool split_names(const char* p, size_t size, uint32_t count, std::vector<std::string>* out, std::string* error) {
  const char* end = p + size;
  while (p < end && out->size() < count) {
    const char* nul = static_cast<const char*>(std::memchr(p, 0, static_cast<size_t>(end - p)));
    if (nul == nullptr || nul == p || static_cast<size_t>(nul - p) > kMaxKernelName) break;
    out->emplace_back(p, nul);
    p = nul + 1;
  }
  if (out->size() == count && p == end) return true;
  *error = "module registration: the kernel names are not " + std::to_string(count) +
           " NUL-terminated names of 1 to 4096 bytes";
  return false;
}

}  // namespace

KernelModules::~KernelModules() {
  for (Module& m : modules_) {
    __cudaUnregisterFatBinary(m.handle);
    munmap(m.map, m.map_size);
  }
}

int64_t KernelModules::add_module(int fd, const RegisterModule& m, std::string* error) {
  struct stat st {};
  const uint64_t want = m.image_size + m.names_size;
  if (fstat(fd, &st) != 0 || want < m.image_size || static_cast<uint64_t>(st.st_size) != want || want == 0) {
    close(fd);
    *error = "module registration: the memfd does not hold the " + std::to_string(want) + " bytes announced";
    return -1;
  }
  void* map = mmap(nullptr, want, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) {
    *error = std::string("module registration: cannot map the module: ") + std::strerror(errno);
    return -1;
  }
  const auto* bytes = static_cast<const uint8_t*>(map);
  FatbinHeader h{};
  if (m.image_size > 0) std::memcpy(&h, bytes, std::min<size_t>(sizeof h, m.image_size));
  std::vector<std::string> names;
  bool ok = true;
  if (m.image_size > 0 &&
      (m.image_size < sizeof h || h.magic != FatbinHeader::kMagic || h.header_size + h.fat_size != m.image_size)) {
    *error = "module registration: the image is not a fat binary of " + std::to_string(m.image_size) + " bytes";
    ok = false;
  }
  ok = ok && split_names(reinterpret_cast<const char*>(bytes + m.image_size), m.names_size, m.num_kernels, &names,
                         error);
  if (!ok) {
    munmap(map, want);
    return -1;
  }

  std::lock_guard<std::mutex> lock(mu_);
  Module& mod = modules_.emplace_back();
  mod.map = map;
  mod.map_size = want;
  mod.wrapper = FatbinWrapper{FatbinWrapper::kMagic, 1, m.image_size ? map : nullptr, nullptr};
  mod.handle = __cudaRegisterFatBinary(&mod.wrapper);  // the wrapper lives as long as the module
  for (std::string& name : names) {
    Kernel& k = kernels_.emplace_back();
    k.name = std::move(name);
    k.stand_in = std::make_unique<char>();
    // The runtime keeps the name pointers: they point into the deque's element, which never moves.
    __cudaRegisterFunction(mod.handle, k.stand_in.get(), k.name.data(), k.name.c_str(), -1, nullptr, nullptr,
                           nullptr, nullptr, nullptr);
    mod.kernels.push_back(static_cast<uint32_t>(kernels_.size() - 1));
  }
  __cudaRegisterFatBinaryEnd(mod.handle);
  return static_cast<int64_t>(modules_.size() - 1);
}

const KernelModules::Kernel* KernelModules::resolve(KernelRef ref, uint32_t* id, std::string* error, int* status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ref.module >= modules_.size() || ref.index >= modules_[ref.module].kernels.size()) {
    *status = cudaErrorInvalidDeviceFunction;
    *error = "kernel registration: no kernel " + std::to_string(ref.index) + " in module " +
             std::to_string(ref.module);
    return nullptr;
  }
  *id = modules_[ref.module].kernels[ref.index];
  Kernel& k = kernels_[*id];
  if (k.known) return &k;
  std::vector<KernelParam> params;
  for (size_t i = 0;; ++i) {
    size_t offset = 0, size = 0;
    const cudaError_t e = cudaFuncGetParamInfo(k.stand_in.get(), i, &offset, &size);
    if (e == cudaErrorInvalidValue) break;  // past the last parameter
    if (e != cudaSuccess) {
      cudaGetLastError();
      *status = e;
      *error = "kernel " + k.name + ": the device runtime has no code for it (" + cudaGetErrorName(e) +
               "; on simcuda: is it in SIMCUDA_KERNEL_LIB?)";
      return nullptr;  // not known: a later use asks again
    }
    params.push_back(KernelParam{static_cast<uint32_t>(offset), static_cast<uint32_t>(size)});
  }
  cudaGetLastError();  // the end-of-list probe is not the application's error
  for (const KernelParam& p : params) k.param_bytes = std::max(k.param_bytes, p.offset + p.size);
  k.params = std::move(params);
  k.known = true;
  return &k;
}

const KernelModules::Kernel* KernelModules::kernel(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  return id < kernels_.size() && kernels_[id].known ? &kernels_[id] : nullptr;
}

}  // namespace jitckpt::proxy
